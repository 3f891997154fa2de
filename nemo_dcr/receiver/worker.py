"""Receiver: check a version, apply it in place, journal it, roll it back on abort.

Which version to apply, acks and decisions are the protocol's (``protocol/follower.py``);
this module does one version.  Order of checks for version ``v`` (nothing is written
until all of them passed):

1. the manifest (sealed, opened by the follower) names this model;
2. its ``base_version`` is the version this receiver holds (else: refusal, no download);
3. every chunk downloads with the listed size and sha256 digest;
4. every chunk decodes (strict decoder) and its own header agrees with the manifest
   (run id, model, version, base);
5. the apply engine validates every delta against the runtime's tensor specs.

Then the journal records old and new bits of every changed element, the deltas are
applied through the runtime's loader and the version is held tentatively.  A failure at
steps 1-5 is a refusal with the weights untouched; a failure during the writes is
repaired from the journal (overwrite with the old bits) before the refusal.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass

from nemo_dcr.codec import DecodeBudget
from nemo_dcr.codec.types import BITS_DTYPE
from nemo_dcr.codec.types import TensorDelta
from nemo_dcr.errors import DcrError, FormatError, ProtocolError, ValidationError
from nemo_dcr.protocol.follower import Follower, wait_for_run
from nemo_dcr.protocol.manifest import Ack, Manifest, check_receiver_id, dense_key
from nemo_dcr.protocol.run import verify_init_dir
from nemo_dcr.protocol.signing import Sealer, load_key
from nemo_dcr.receiver.fetch import RefitRefused, fetch_chunks
from nemo_dcr.receiver.held import HeldBits
from nemo_dcr.receiver.journal import ApplyJournal, write_durably, write_text
from nemo_dcr.transport.store import ObjectStore, open_store


@dataclass(kw_only=True, frozen=True)
class ReceiverConfig:
    receiver_id: str
    """Name under which acknowledgements are written (``acks/<id>/``)."""
    model_id: str
    """Manifests of any other model are refused."""
    poll_s: float = 0.05
    """Interval between checks for the next manifest."""
    verify_dense: bool = False
    """After each apply, compare every parameter and buffer with a dense refit of the same
    version (``v/<v>/dense.safetensors`` loaded through the same loader into a second
    model) and report ``bit_exact`` in the ack.  Verification only: doubles memory."""
    fetch_threads: int = 0
    """Chunks downloaded, verified and decoded at once (the coder releases the GIL);
    0: one per CPU core, at most 8."""

    def __post_init__(self) -> None:
        check_receiver_id(self.receiver_id)
        if self.poll_s <= 0:
            raise ValueError("poll_s must be positive")
        if self.fetch_threads < 0:
            raise ValueError("fetch_threads must be >= 0")

    @property
    def threads(self) -> int:
        return self.fetch_threads or max(1, min(8, os.cpu_count() or 1))


class Receiver:
    def __init__(self, applier, store: ObjectStore, cfg: ReceiverConfig, *, held_version: int = 0,
                 reference=None, journal_dir: str | None = None, committed_file: str | None = None):
        """``applier``: a ``ServedModel`` (``receiver/served.py``), or a prewarmed
        ``DeltaApplier`` with ``reference``, a second runtime adapter used by
        ``verify_dense`` (they are wrapped in an ``InProcessModel``).
        ``journal_dir`` / ``committed_file``: for a runtime whose weights outlive this
        process (``runtimes/persistent.py``): the journal is written there before the
        first write of a version, and the committed version after each commit."""
        from nemo_dcr.receiver.apply import DeltaApplier
        from nemo_dcr.receiver.served import InProcessModel

        if isinstance(applier, DeltaApplier):
            if cfg.verify_dense and reference is None:
                raise ValueError("verify_dense needs a reference runtime")
            self.served = InProcessModel(applier, reference)
        else:
            self.served = applier
        self.store = store
        self.cfg = cfg
        self.held_version = held_version
        self.journal = ApplyJournal(journal_dir)
        self.committed_file = committed_file
        self.on_applied = None  # optional fn(version), called after each applied version

    # --------------------------------------------------------------- one version
    def fetch(self, manifest: Manifest) -> tuple[list[TensorDelta], dict]:
        """Steps 2-4: download, verify and decode every chunk; raises RefitRefused."""
        deltas, _, stats = self._fetch(manifest)
        return deltas, stats

    def _fetch(self, manifest: Manifest, *, base: Mapping | None = None, base_version: int | None = None
               ) -> tuple[list[TensorDelta], Mapping, dict]:
        """``base``: the canonical bits the records apply to (default: what the runtime
        holds) at ``base_version`` (default: ``held_version``)."""
        expect = self.held_version if base_version is None else base_version
        if manifest.model_id != self.cfg.model_id:
            raise RefitRefused(f"manifest v{manifest.version} is for model {manifest.model_id!r}, "
                               f"this receiver serves {self.cfg.model_id!r}")
        if manifest.base_version != expect:
            raise RefitRefused(f"manifest v{manifest.version} has base version {manifest.base_version}, "
                               f"this receiver holds version {expect}")
        specs = self.served.tensor_specs()
        # untrusted sizes are bounded before anything is downloaded or decoded: the version's
        # wire bytes by twice the dense size of what it may change, duplicates refused, and
        # every record checked against the runtime's specs and a per-version budget from its
        # header alone (codec/admit.py)
        dense = sum(s.numel * BITS_DTYPE[s.dtype].itemsize for s in specs.values())
        if manifest.wire_bytes > 2 * dense + (1 << 20):
            raise RefitRefused(f"manifest v{manifest.version} lists {manifest.wire_bytes} chunk bytes, more than "
                               f"twice the {dense} bytes of the tensors this receiver holds")
        digests = [ref.digest for ref in manifest.chunks]
        if len(set(digests)) != len(digests):
            raise RefitRefused(f"manifest v{manifest.version} lists the same chunk bytes twice")
        budget = DecodeBudget.for_tensors(specs)
        held = HeldBits(self.served) if base is None else base
        want = {"run_id": manifest.run_id, "model_id": manifest.model_id, "version": str(manifest.version),
                "base_version": str(manifest.base_version)}
        t0 = time.perf_counter()
        got = fetch_chunks(self.store, manifest.chunks, held=held, specs=specs, budget=budget, want=want,
                           threads=self.cfg.threads)
        deltas = [d for chunk in got.chunks for d in chunk.deltas]
        return deltas, held, {"download_s": got.downloaded_at - t0, "decode_s": got.done_at - got.downloaded_at,
                              "decode_cpu_s": got.decode_cpu_s, "decode_gbps": got.decode_gbps,
                              "fetch_threads": self.cfg.threads,
                              "wire_bytes": manifest.wire_bytes, "changed": sum(d.nnz for d in deltas)}

    def apply_version(self, manifest: Manifest) -> dict:
        """Fetch, journal and apply ``manifest`` in place.  A refusal before the first write
        leaves the weights untouched; a failure during the writes is repaired from the
        journal (undo by overwrite), so either way the runtime ends exactly at the base and
        ``RefitRefused`` says what happened.  On success the version is held tentatively
        until :meth:`settle` (committed) or :meth:`rollback` (aborted)."""
        deltas, held, stats = self._fetch(manifest)
        stats["apply_s"] = self.apply_records(manifest.version, manifest.base_version, deltas, held)
        return stats

    def apply_records(self, version: int, base_version: int, deltas: list[TensorDelta], held: Mapping) -> float:
        """Validate, journal and apply decoded ``deltas`` taking ``base_version`` (held now,
        whose bits ``held`` maps) to ``version``; returns the seconds spent."""
        t0 = time.perf_counter()
        try:
            self.served.validate(deltas)
        except ValueError as e:  # DeltaValidationError and friends: nothing written
            raise RefitRefused(str(e)) from None
        self.journal.begin(version, base_version, deltas, held)
        try:
            self.served.apply(deltas)
        except Exception as e:  # noqa: BLE001 - any failure mid-write is repaired, then reported
            self._undo()
            raise RefitRefused(f"apply of v{version} failed ({type(e).__name__}: {e}); "
                               f"repaired from the journal, holding v{base_version}") from None
        self.journal.mark("applied")
        self.held_version = version
        if self.on_applied is not None:
            self.on_applied(version)
        return time.perf_counter() - t0

    def _undo(self) -> None:
        records = self.journal.undo_records()
        base = self.journal.base_version
        self.served.apply(records)
        self.journal.clear()
        self.held_version = base

    def apply_tentative(self, manifest: Manifest, manifest_digest: str, *, run_id: str) -> Ack:
        """Apply ``manifest`` and answer it: ``ok`` only if applied and, when verifying,
        bit-exact (a version that is not is rolled back at once and refused)."""
        def refusal(error: str) -> Ack:
            return Ack(run_id=run_id, receiver=self.cfg.receiver_id, version=manifest.version, ok=False,
                       held_version=self.held_version, error=error)

        try:
            stats = self.apply_version(manifest)
        except RefitRefused as e:
            return refusal(str(e))
        if self.cfg.verify_dense:
            try:
                stats.update(self.verify_against_dense(manifest.version))
            except (FormatError, ValueError) as e:  # the unsigned reference is oversized or malformed
                self.rollback()
                return refusal(f"dense reference of v{manifest.version} unusable ({e}); rolled back")
            if not stats.get("bit_exact"):
                self.rollback()
                return refusal(f"not bit-exact against the dense reference of v{manifest.version} "
                               f"(mismatches: {stats.get('mismatches')}); rolled back")
        sample = self.served.sample()
        if sample is not None:
            stats["sample"] = sample
        return Ack(run_id=run_id, receiver=self.cfg.receiver_id, version=manifest.version, ok=True,
                   held_version=self.held_version, manifest_digest=manifest_digest, stats=stats)

    def apply_committed(self, manifest: Manifest, decision_digest: str) -> dict:
        """Catch-up: apply a version the trainer already committed (no ack is needed);
        ``decision_digest``: its commit decision's digest (see :meth:`settle`)."""
        stats = self.apply_version(manifest)
        self.settle(decision_digest)
        return stats

    def apply_chain(self, manifests: list[Manifest], decision_digest: str) -> dict:
        """Catch-up: apply committed versions (a chain starting at the held version) as one
        composed write (``receiver/catchup.py``); no ack is needed."""
        from nemo_dcr.receiver.catchup import compose

        try:
            deltas, held, stats = compose(self, manifests)
        except ValueError as e:  # validation of a record against the runtime: nothing written
            raise RefitRefused(str(e)) from None
        stats["apply_s"] = self.apply_records(manifests[-1].version, self.held_version, deltas, held)
        self.settle(decision_digest)
        return stats

    def settle(self, decision_digest: str) -> None:
        """The tentative version was committed by the decision whose bytes hash to
        ``decision_digest``: record both (before the journal goes, so a crash in between
        leaves a journal older than the record, which :meth:`recover` drops), then drop
        its journal."""
        if self.committed_file:
            write_committed(self.committed_file, self.held_version, decision_digest)
        self.journal.clear()

    def recover(self, committed: int) -> dict | None:
        """After a restart over persistent weights holding ``committed`` plus possibly a
        half-applied version: undo it from the journal the previous process left (an
        overwrite with the old bits, correct whichever writes had landed).  Returns what
        was done, or None."""
        journal = ApplyJournal.load(self.journal.directory) if self.journal.directory else self.journal
        self.held_version = committed
        if not journal.active:
            return None
        if journal.version <= committed:  # committed, then killed before the journal was dropped
            journal.clear()
            return {"event": "dropped stale journal", "version": journal.version}
        if journal.base_version != committed:
            raise ProtocolError(f"journal of v{journal.version} has base v{journal.base_version}, "
                                f"the committed version is v{committed}")
        t0 = time.perf_counter()
        event = {"event": "repaired", "version": journal.version, "phase": journal.phase}
        self.journal = journal
        self._undo()
        return {**event, "repair_s": round(time.perf_counter() - t0, 4)}

    def rollback(self) -> None:
        """The tentative version was aborted: overwrite every element it changed with its
        base bits, in place, through the same apply path."""
        if not self.journal.active:
            raise RuntimeError("rollback without a tentative version")
        self._undo()

    def verify_against_dense(self, version: int) -> dict:
        from safetensors.torch import load as load_safetensors

        t0 = time.perf_counter()
        # unsigned test aid: bounded by the dense size of what this receiver holds (+ header)
        cap = sum(s.numel * BITS_DTYPE[s.dtype].itemsize for s in self.served.tensor_specs().values()) + (64 << 20)
        dense = load_safetensors(self.store.get(dense_key(version), max_bytes=cap))
        report = self.served.verify_dense(dense)
        return {**report, "verify_s": time.perf_counter() - t0}



def _init_dir(store: ObjectStore, sealer: Sealer, run_id: str, init_dir: str | None, state_dir: str,
              timeout_s: float | None) -> tuple[str, str]:
    """The version-0 checkpoint to load: ``init_dir`` if given, else a download of the
    store's ``init/`` into ``state_dir``; either way checked against the run's signed
    ``init/INIT.json`` (waiting for it to be published).  Returns the directory and the
    record's digest (the root of the run's chain)."""
    from nemo_dcr.integrations.hf_export import download_checkpoint
    from nemo_dcr.protocol.manifest import INIT_RECORD_KEY

    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    while not store.exists(INIT_RECORD_KEY):
        if deadline is not None and time.monotonic() > deadline:
            raise ProtocolError(f"store {store.uri}: version 0 ({INIT_RECORD_KEY}) not published within {timeout_s}s")
        time.sleep(0.1)
    if init_dir is None:
        init_dir = download_checkpoint(store, os.path.join(state_dir, "init"))
    return init_dir, verify_init_dir(store, sealer, run_id, init_dir)


def write_committed(path: str, version: int, digest: str) -> None:
    """The receiver's own record of what it committed (its link in the run's chain)."""
    write_durably(path, lambda p: write_text(p, json.dumps({"committed": version, "digest": digest})))


def read_committed(path: str) -> tuple[int, str]:
    """(version, decision digest) recorded by :func:`write_committed`; (0, '') when none."""
    try:
        with open(path) as f:
            rec = json.load(f)
        v, digest = rec["committed"], rec["digest"]
    except FileNotFoundError:
        return 0, ""
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ProtocolError(f"{path}: unreadable committed-version record ({e})") from None
    if not isinstance(v, int) or isinstance(v, bool) or v < 0 or not isinstance(digest, str):
        raise ProtocolError(f"{path}: committed version must be a non-negative int with a digest, got {v!r}")
    return v, digest


def main(argv: list[str] | None = None) -> int:
    """``nemo-dcr receive`` / ``python -m nemo_dcr.receiver.worker``: a receiver keeping a
    transformers model or a vLLM engine at the versions a store publishes."""
    ap = argparse.ArgumentParser(prog="nemo-dcr receive")
    ap.add_argument("--store", required=True, help="store URI (directory or fsspec URI)")
    ap.add_argument("--receiver-id", required=True)
    ap.add_argument("--model-id", required=True)
    ap.add_argument("--key-file", default=None,
                    help="the run's shared signing key (default: $NEMO_DCR_KEY_FILE)")
    ap.add_argument("--insecure-no-key", action="store_true",
                    help="follow a signed run WITHOUT its key, checking no signature (anyone who can write "
                         "to the store can then make this receiver apply anything); refused otherwise")
    ap.add_argument("--run-id", default=None, help="follow only this run (default: the store's RUN.json)")
    ap.add_argument("--state-dir", default=None,
                    help="local directory for a downloaded version 0 and, with --persistent-weights, the "
                         "weights file, the apply journal and the committed version (default: a fresh "
                         "temporary directory)")
    ap.add_argument("--persistent-weights", action="store_true",
                    help="hf runtime: keep the parameters in a shared file mapping under --state-dir, so a "
                         "receiver killed mid-apply restarts over its own weights and repairs them from the "
                         "journal instead of reloading version 0 and catching up")
    ap.add_argument("--until-version", type=int, default=None,
                    help="exit once the trainer decided on this version (committed or aborted)")
    ap.add_argument("--timeout-s", type=float, default=None,
                    help="give up when nothing new appears for this long (default: wait forever)")
    ap.add_argument("--verify-dense", action="store_true")
    ap.add_argument("--init-dir", default=None,
                    help="local copy of the initial HF checkpoint (checked against the run's init/INIT.json; "
                         "default: download it from the store)")
    ap.add_argument("--runtime", choices=("hf", "vllm"), default="hf",
                    help="serving runtime kept current: a transformers model in this process, or a vllm.LLM engine")
    ap.add_argument("--tensor-parallel-size", type=int, default=1, help="vLLM only: TP workers of the engine")
    ap.add_argument("--max-model-len", type=int, default=None, help="vLLM only: the engine's context length")
    ap.add_argument("--sample-tokens", type=int, default=0,
                    help="vLLM only: greedy tokens generated after every refit and reported in the ack")
    ap.add_argument("--dump-dir", default=None,
                    help="testing aid: after each applied version write every parameter and buffer "
                         "to DIR/v<version>.safetensors")
    def one_line(message: str):  # argparse's default prints the whole usage block
        print(f"nemo-dcr receive: {message} (see --help)", file=sys.stderr, flush=True)
        sys.exit(2)

    ap.error = one_line
    args = ap.parse_args(argv)
    try:
        return _serve(args)
    except (DcrError, TimeoutError) as e:
        print(f"nemo-dcr receive: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
        return 1


def _serve(args) -> int:
    import tempfile

    store = open_store(args.store)
    cfg = ReceiverConfig(receiver_id=args.receiver_id, model_id=args.model_id, verify_dense=args.verify_dense)
    sealer = Sealer(load_key(args.key_file, log=lambda m: print(m, file=sys.stderr, flush=True)))
    if args.persistent_weights and (args.runtime != "hf" or not args.state_dir):
        raise ValidationError("--persistent-weights needs --runtime hf and a --state-dir")
    state_dir = args.state_dir or tempfile.mkdtemp(prefix=f"dcr-{args.receiver_id}-")
    if args.insecure_no_key:
        if sealer.signed:
            raise ValidationError("--insecure-no-key with a key: drop one of them")
        print(f"nemo-dcr receive: WARNING: --insecure-no-key: following {args.store} WITHOUT checking any "
              "signature; anyone who can write to the store can make this receiver apply anything",
              file=sys.stderr, flush=True)
    run_id = wait_for_run(store, sealer, run_id=args.run_id, timeout_s=args.timeout_s,
                          allow_unverified=args.insecure_no_key)
    init_dir, root = _init_dir(store, sealer, run_id, args.init_dir, state_dir, args.timeout_s)
    committed, committed_digest, recovered = 0, root, None
    if args.runtime == "vllm":
        from nemo_dcr.runtimes.vllm.served import VLLMServedModel

        served = VLLMServedModel.start(init_dir, tensor_parallel_size=args.tensor_parallel_size,
                                       max_model_len=args.max_model_len, reference=args.verify_dense,
                                       sample_tokens=args.sample_tokens)
        rx = Receiver(served, store, cfg)
        if args.dump_dir:
            rx.on_applied = lambda version: served.dump(args.dump_dir, version)
    else:
        from nemo_dcr.receiver.apply import DeltaApplier
        from nemo_dcr.runtimes.hf import HFTransformersAdapter, checkpoint_specs

        journal_dir = committed_file = None
        if args.persistent_weights:
            from nemo_dcr.runtimes.persistent import bind_persistent, model_skeleton

            wdir = os.path.join(state_dir, "weights")
            journal_dir, committed_file = os.path.join(state_dir, "journal"), os.path.join(state_dir, "committed.json")
            if os.path.exists(os.path.join(wdir, "weights.json")):  # restart: map our own weights
                adapter = HFTransformersAdapter(model_skeleton(init_dir), specs=checkpoint_specs(init_dir),
                                                checkpoint_dir=init_dir)
                committed, committed_digest = read_committed(committed_file)
            else:
                adapter = HFTransformersAdapter.from_pretrained(init_dir)
            bind_persistent(adapter.module, wdir, run_id)
        else:
            adapter = HFTransformersAdapter.from_pretrained(init_dir)
        applier = DeltaApplier(adapter)
        applier.prewarm()
        reference = HFTransformersAdapter.from_pretrained(init_dir) if args.verify_dense else None
        rx = Receiver(applier, store, cfg, reference=reference, journal_dir=journal_dir,
                      committed_file=committed_file)
        recovered = rx.recover(committed)
        if args.dump_dir:
            rx.on_applied = lambda version: dump_state(adapter.module, args.dump_dir, version)
    if recovered is not None:
        print(json.dumps({"receiver": args.receiver_id, **recovered, "held": committed}), flush=True)
    print(json.dumps({"receiver": args.receiver_id, "ready": True, "run_id": run_id, "held": committed}), flush=True)
    follower = Follower(rx, store, sealer, run_id, receiver_id=args.receiver_id, committed=committed,
                        committed_digest=committed_digest)
    try:
        follower.run(until_version=args.until_version, timeout_s=args.timeout_s, poll_s=cfg.poll_s)
    finally:
        if args.runtime == "vllm":
            served.close()
    return 0


def dump_state(module, directory: str, version: int) -> None:
    import os

    from safetensors.torch import save_file

    from nemo_dcr.receiver.verify import module_state

    os.makedirs(directory, exist_ok=True)
    save_file({k: v.contiguous().clone() for k, v in module_state(module).items()},
              os.path.join(directory, f"v{version}.safetensors"))


if __name__ == "__main__":
    sys.exit(main())
