"""Rank 0's decision on a version: totals over ranks, manifest, acks, decision record.

The joint commit itself (who must ack, timeouts, elastic membership, the records) is
``protocol/commit.py``'s :class:`~nemo_dcr.protocol.commit.CommitCoordinator`; this module
is the sender's use of it, one version at a time, and the refusal policy
(:class:`~nemo_dcr.protocol.commit.FailureBudget`) that says when training stops.
"""
from __future__ import annotations

import time
from collections.abc import Callable, Sequence

from nemo_dcr.protocol.commit import CommitCoordinator, FailureBudget
from nemo_dcr.protocol.manifest import Manifest
from nemo_dcr.sender.collectives import log
from nemo_dcr.sender.stats import PublishStats, RankReport, Verdict

STAGE_TIMES = ("diff_s", "project_s", "encode_s", "upload_s", "publish_s", "pause_s")
"""Per-stage times whose total over ranks is the slowest rank's (ranks run in parallel)."""


def add_rank_totals(stats: PublishStats, reports: Sequence[RankReport]) -> None:
    """Rank 0's ``stats`` (its own, ``reports[0].stats``) become totals over every rank."""
    for rep in reports[1:]:
        st = rep.stats
        stats.changed += st.changed
        stats.numel += st.numel
        stats.raw_bytes += st.raw_bytes
        stats.encode_cpu_s += st.encode_cpu_s
        for t in STAGE_TIMES:
            setattr(stats, t, max(getattr(stats, t), getattr(st, t)))
    refs = [r for rep in reports for r in rep.refs]
    stats.chunks = len(refs)
    stats.wire_bytes = sum(r.nbytes for r in refs)


class Decider:
    """Rank 0, from the run's claim on: one decision per version, in order."""

    def __init__(self, coordinator: CommitCoordinator, failures: FailureBudget, *, run_id: str, model_id: str):
        self.coordinator, self.failures = coordinator, failures
        self.run_id, self.model_id = run_id, model_id

    def decide(self, version: int, stats: PublishStats, reports: Sequence[RankReport], *, base_digest: str,
               dense_bytes: int, before_manifest: Callable[[Manifest], None] | None) -> Verdict:
        """Totals into ``stats``, then the manifest (unless a rank failed), the acks and the
        decision record.  Never raises: any failure is an abort with its reason (the policy
        decides whether training stops)."""
        errors = [rep.error for rep in reports if rep.error is not None]
        add_rank_totals(stats, reports)
        stats.dense_bytes = dense_bytes
        reason = "; ".join(errors)
        commit = False
        digest = ""
        t0 = time.perf_counter()
        try:
            if not errors:
                manifest = Manifest(run_id=self.run_id, model_id=self.model_id, version=version,
                                    base_version=stats.base_version, base_digest=base_digest,
                                    chunks=tuple(r for rep in reports for r in rep.refs),
                                    stats={"changed": float(stats.changed)})
                if before_manifest is not None:
                    before_manifest(manifest)
                digest = self.coordinator.publish(manifest)
                t0 = time.perf_counter()
                outcome = self.coordinator.collect_acks(version, digest)
                stats.acks = outcome.acks
                stats.members = outcome.members or tuple(self.coordinator.receivers)
                stats.joined, stats.evicted = outcome.joined, outcome.evicted
                for line in outcome.ignored:
                    log(f"nemo_dcr: version {version}: ignored ack {line}")
                commit, reason = outcome.ok, outcome.reason
        except Exception as e:  # noqa: BLE001 - e.g. the store failed: abort, never half-commit
            commit, reason = False, (reason + "; " if reason else "") + f"rank 0: {type(e).__name__}: {e}"
        stats.commit_wait_s = time.perf_counter() - t0
        decision_digest = ""
        try:
            decision_digest = self.coordinator.decide(version, stats.base_version, commit, reason, digest)
        except Exception as e:  # noqa: BLE001
            if commit:
                # the commit record may have landed (receivers would then hold v as committed)
                # or not: the trainer cannot know which, so it neither advances nor goes on
                self.failures.record(False)
                return Verdict(commit=False, stop=True, digest="", reason=(
                    f"the commit decision on version {version} could not be recorded ({type(e).__name__}: {e}); "
                    "receivers may hold it as committed: stop, then resume the run, which reads the decision "
                    "records"))
            # an unrecorded abort is safe: receivers infer it from the chain of the next HEAD
            reason += f"; decision record not written ({type(e).__name__}: {e})"
        return Verdict(commit=commit, reason=reason, stop=self.failures.record(commit), digest=decision_digest)
