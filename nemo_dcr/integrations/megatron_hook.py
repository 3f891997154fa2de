"""The refit hook for Megatron-Core training: runs on every rank after each optimizer step.

It is the single object a training loop needs: ``Trainer.add_post_step_hook(hook)`` in our
test bed, a Lightning/NeMo callback's ``on_train_batch_end`` in a NeMo recipe.  Build it
with :meth:`MegatronRefitHook.from_model` from the model the trainer holds; everything
else is derived from that model:

* the architecture from its ``TransformerConfig`` and modules (``describe_gpt``), and from
  that the layout family (``layout/families.py``: one declarative rule table each);
* where every local element lives, from ``sharded_state_dict()`` (TP/PP/EP shards,
  ``replica_id`` for DP / expert-DP replicas and the tied output layer of the last
  pipeline stage, which Megatron checkpoints as a non-main replica of the embedding).

Construction is collective and fails closed, on every rank with the same message (ranks
agree before any further collective), before anything is published: a parameter
no ShardedTensor covers (or covers twice), a parameter whose Megatron key the family
table does not map, or a global tensor whose main replicas over all ranks do not tile it
exactly once is refused with the parameter's (or key's) name.

When to call it: after ``optimizer.step()`` on every rank.  With megatron's distributed
optimizer each rank updates only its shard of the BF16 params and the all-gather of the
rest runs at the end of ``step()`` -- unless ``overlap_param_gather=True`` defers it into
the next forward's pre-hooks.  The hook handles both: when ``from_model`` finds a DDP
wrapper with the deferred gather, every call first forces it (synchronously; the next
forward then finds it done and does not gather again).
"""
from __future__ import annotations

import time

import torch
from safetensors.torch import save as save_safetensors

from nemo_dcr.errors import PlacementError, ProtocolError, ValidationError
from nemo_dcr.integrations.dense import gather_canonical_state
from nemo_dcr.integrations.hf_export import hf_config, write_checkpoint
from nemo_dcr.integrations.megatron_model import deferred_param_gathers, describe_gpt, unwrap_gpt
from nemo_dcr.sender import PublishStats, RefitOptions, RefitSender
from nemo_dcr.sender.collectives import agree_or_raise, all_gather, rank
from nemo_dcr.layout.families import ModelFamily, UnsupportedModelError, select_family
from nemo_dcr.layout.mapping import CanonicalProjector, ModelDims, UnmappedKeyError
from nemo_dcr.layout.shards import ParamView, check_tiling, collect_param_views
from nemo_dcr.protocol.manifest import dense_key
from nemo_dcr.protocol.history import RunState
from nemo_dcr.transport.store import ObjectStore


def _check_mapped(views: dict[str, list[ParamView]], projector: CanonicalProjector, family: ModelFamily) -> None:
    """Every local parameter range has a rule that fits its geometry (all replicas, not
    only main ones: a rank must not hold weights the table cannot name)."""
    for pname, vs in views.items():
        for v in vs:
            try:
                projector.check(v.spec)
            except UnmappedKeyError:
                raise UnsupportedModelError(
                    f"parameter {pname} (Megatron key {v.spec.key}) has no rule in the {family.name} layout "
                    "table; refusing to attach rather than never refitting it") from None
            except (PlacementError, ValidationError) as e:  # the rule does not fit the shard's geometry
                raise UnsupportedModelError(f"parameter {pname}: {e}") from None


def _check_global_tiling(views: dict[str, list[ParamView]]) -> None:
    mine = [v.spec for vs in views.values() for v in vs if v.spec.is_main_replica]
    check_tiling([s for rank_specs in all_gather(mine) for s in rank_specs])


class MegatronRefitHook:
    """Diff -> project -> encode -> upload after each step, then the joint commit."""

    def __init__(self, gpt: torch.nn.Module, dims: ModelDims, family: ModelFamily, store: ObjectStore,
                 sender_cfg: RefitOptions, *, verify_dense: bool = False):
        """Prefer :meth:`from_model`.  ``gpt``: this rank's megatron ``GPTModel``."""
        self.dims = dims
        self.family = family
        self.store = store
        self.verify_dense = verify_dense
        self.params = dict(gpt.named_parameters())
        self.projector = CanonicalProjector(family.rules, dims)
        error = None
        try:
            self.views = collect_param_views(gpt)
            _check_mapped(self.views, self.projector, family)
        except UnsupportedModelError as e:
            error = str(e)
        except (PlacementError, ValidationError) as e:  # LayoutError: the shards do not tile
            error = f"sharded_state_dict() does not describe the model: {e}"
        agree_or_raise(error, UnsupportedModelError)
        try:
            _check_global_tiling(self.views)
        except (PlacementError, ValidationError) as e:
            raise UnsupportedModelError(f"sharded_state_dict() over all ranks: {e}") from None
        self.sender = RefitSender(self.params, self.views, self.projector, store, sender_cfg,
                                  snapshot_state=self.committed_state)
        self.last_stats: PublishStats | None = None
        self._reference_s: dict[int, float] = {}  # verify_dense: gather time per version in flight
        self._param_gathers: list = []

    @classmethod
    def from_model(cls, model, *, store: ObjectStore, sender_cfg: RefitOptions, family: str | None = None,
                   vocab_size: int | None = None, verify_dense: bool = False) -> MegatronRefitHook:
        """Collective: attach to ``model`` (a ``GPTModel``, any wrapper of one, or a list of
        virtual-pipeline model chunks: ``megatron_model.unwrap_gpt``) on every rank.

        family: a name in ``layout.families.FAMILIES``; by default the one registered family
            the model's features (MoE, q/k-norm) match.  Given, it is checked against them.
        vocab_size: the tokenizer's vocabulary (Megatron's padded rows beyond it are not
            canonical); default: the model's padded vocabulary.
        """
        error = None
        try:
            gpt = unwrap_gpt(model)
            dims = describe_gpt(gpt, vocab_size=vocab_size)
            chosen = select_family(dims, family)
        except (PlacementError, ValidationError) as e:  # UnsupportedModelError included; a bug is not a refusal
            error = str(e)
        agree_or_raise(error, UnsupportedModelError)
        hook = cls(gpt, dims, chosen, store, sender_cfg, verify_dense=verify_dense)
        hook._param_gathers = deferred_param_gathers(model)
        return hook

    def sync_params(self) -> None:
        """Collective: finish a distributed optimizer's deferred BF16 all-gather, if the
        model has one (``overlap_param_gather=True``; see the module docstring).  Every
        call of the hook does this first."""
        for ddp in self._param_gathers:
            ddp.start_param_sync(force_sync=True)

    def hf_config(self) -> dict:
        """``config.json`` of the equivalent Hugging Face model."""
        return hf_config(self.family, self.dims)

    def dense_state(self) -> dict[str, torch.Tensor] | None:
        """Collective: the full canonical state on rank 0 (None elsewhere)."""
        return gather_canonical_state(self.params, self.views, self.projector)

    def committed_state(self) -> dict[str, torch.Tensor] | None:
        """Collective: the full canonical state of the COMMITTED version on rank 0 (None
        elsewhere), gathered like version 0 but from the sender's baseline, not the live
        parameters (which already hold the next step): a committed-version snapshot
        (``refit.snapshot_every``), taken by the sender right after it settles a commit."""
        return gather_canonical_state(self.sender.committed_bits(), self.views, self.projector)

    @property
    def run_id(self) -> str | None:
        return self.sender.run_id

    def export_initial(self) -> str:
        """Collective: start a new run on the store (refusing a prefix another run owns)
        and write its version 0 (the initial HF checkpoint + its signed digests); returns
        the run id."""
        run_id = self.sender.claim()
        state = self.dense_state()
        error = None
        root = ""
        if rank() == 0:
            try:
                root = write_checkpoint(self.store, self.hf_config(), state, sealer=self.sender.sealer, run_id=run_id)
            except Exception as e:  # noqa: BLE001 - every rank must learn it (no rank left in a collective)
                error = f"writing version 0 to {self.store.uri} failed: {type(e).__name__}: {e}"
        agree_or_raise(error, ProtocolError)
        self.sender.set_root(root)
        return run_id

    def resume(self, state: RunState) -> None:
        """Collective: continue the run of ``state`` (restored from the trainer's checkpoint,
        together with the weights it describes), checked against the store's signed history."""
        self.sender.claim(resume=state)

    def run_state(self) -> RunState:
        """The refit's run state, for the trainer's checkpoint (``RunState.to_dict()``)."""
        return self.sender.run_state()

    def __call__(self, trainer=None, step: int | None = None) -> PublishStats | None:
        """Publish a version (collective): ``step`` (the optimizer step just taken) if
        given, else one past the last version published.  A version number is never
        reused, also after a refused one.  (``trainer`` is the test bed's hook argument.)

        Returns the stats of the version decided in this call, also kept as ``last_stats``:
        with ``pipeline`` (the default) the previous version's, settled before this one is
        diffed (None for the first), else this version's.  Call :meth:`finish` after the
        last step."""
        self.sync_params()
        before = None
        dense_s = 0.0
        if self.verify_dense:
            t0 = time.perf_counter()
            state = self.dense_state()
            dense_s = time.perf_counter() - t0
            if rank() == 0:
                def before(manifest, state=state):
                    self.store.put(dense_key(manifest.version), save_safetensors(state))
        version = self.sender.published_version + 1 if step is None else int(step)
        if self.sender.cfg.pipeline:
            settled = self.sender.submit(version, before_manifest=before)
        else:
            settled = self.sender.refit(version, before_manifest=before)
        if settled is not None:
            self.last_stats = settled
        self._reference_s[version] = dense_s
        if settled is not None:
            settled.reference_s = self._reference_s.pop(settled.version, 0.0)
        return settled

    def finish(self) -> PublishStats | None:
        """Collective: drain the pipelined refit at the end of training: the version in flight
        (if any) is decided and its stats returned (also as ``last_stats``)."""
        settled = self.sender.finish()
        if settled is not None:
            settled.reference_s = self._reference_s.pop(settled.version, 0.0)
            self.last_stats = settled
        return settled
