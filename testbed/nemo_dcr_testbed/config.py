"""Configuration of the end-to-end job: keyword-only dataclasses are the schema, Hydra
(the test bed's packaged ``configs/demo.yaml`` + command-line overrides) is only the edge.

``load_demo_config(overrides)`` composes ``demo.yaml`` with Hydra's override grammar
(``model.vocab_size=1003``, ``steps=5``) through the one strict loader
(:func:`nemo_dcr.configs.load_config`): unknown keys (``model.famly=...`` as well as Hydra's
``+key=`` / ``++key=`` additions) and wrong types are errors, and every dataclass's
``__post_init__`` validates its values.  Every refusal is one :class:`ConfigError` line.

The ``refit`` section is the refit schema itself (``RefitOptions``, the same keys, types
and defaults as a NeMo / Bridge callback's ``refit.*``) plus two test-bed aids.
"""
from __future__ import annotations

import ast
import dataclasses
import inspect
import textwrap
import typing
from contextlib import ExitStack
from dataclasses import asdict, dataclass, field
from importlib import resources

from nemo_dcr.configs import (ConfigError, build, check_override_keys,  # noqa: F401 - re-exported
                              describe_config_error, load_config)
from nemo_dcr.integrations.settings import RefitOptions
from nemo_dcr_testbed.model import ModelConfig
from nemo_dcr_testbed.train import TrainConfig


@dataclass(kw_only=True)
class ParallelConfig:
    tensor_model_parallel_size: int = 2
    """Megatron tensor parallelism (ranks per model replica along hidden dims)."""
    pipeline_model_parallel_size: int = 1
    """Megatron pipeline parallelism (stages)."""
    data_parallel_size: int = 1
    """Model replicas; only the main replica of each element (Megatron's replica_id) emits."""
    expert_model_parallel_size: int = 1
    """Megatron expert parallelism (MoE models): the experts of each layer are split over this
    many ranks.  It regroups ranks within the world (it does not multiply it): megatron needs
    ``tp * ep * pp`` to divide the world (``initialize_model_parallel``, expert TP = TP), i.e.
    EP must divide ``data_parallel_size``."""
    num_layers_in_first_pipeline_stage: int = 0
    """Transformer layers on the first pipeline stage; 0 = even split (megatron's
    ``num_layers_in_first_pipeline_stage`` unset)."""
    num_layers_in_last_pipeline_stage: int = 0
    """Transformer layers on the last pipeline stage; 0 = even split."""

    def __post_init__(self) -> None:
        for name in ("tensor_model_parallel_size", "pipeline_model_parallel_size",
                     "data_parallel_size", "expert_model_parallel_size",
                     "num_layers_in_first_pipeline_stage", "num_layers_in_last_pipeline_stage"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool):
                raise TypeError(f"parallel.{name} must be an int, got {v!r}")
        if min(self.tensor_model_parallel_size, self.pipeline_model_parallel_size,
               self.data_parallel_size, self.expert_model_parallel_size) < 1:
            raise ValueError("parallel sizes must be >= 1")
        if min(self.num_layers_in_first_pipeline_stage, self.num_layers_in_last_pipeline_stage) < 0:
            raise ValueError("parallel.num_layers_in_first/last_pipeline_stage must be >= 0 (0 = even split)")
        if self.data_parallel_size % self.expert_model_parallel_size:
            raise ValueError(
                f"parallel.expert_model_parallel_size={self.expert_model_parallel_size} must divide "
                f"data_parallel_size={self.data_parallel_size}: megatron's initialize_model_parallel "
                f"needs tp*ep*pp to divide the world size tp*pp*dp (expert TP = TP)"
            )

    @property
    def world_size(self) -> int:
        return self.tensor_model_parallel_size * self.pipeline_model_parallel_size * self.data_parallel_size


@dataclass(kw_only=True)
class StoreConfig:
    uri: str = "runs/demo/store"
    """Where chunks and manifests go: a directory (the embedded default) or an fsspec URI."""
    reset: bool = False
    """Demo only: empty a previous demo store at this URI first (only if it holds a
    nemo_dcr store marker; any other non-empty directory is always refused).  Off by
    default: a store holding a previous run is refused, so a new run never deletes an
    old one's objects unless asked (``store.reset=true`` or ``force=true``)."""


TRANSPORTS = ("store", "relay")
"""``refit.transport``'s values (the demo's topology, not the refit's: see ``RefitConfig``)."""


@dataclass(kw_only=True, frozen=True)
class RefitConfig(RefitOptions):
    """The refit schema (every ``refit.*`` key a callback takes that applies to a refit run
    by the demo) plus the test bed's verification aids and how its receivers read the store
    (``transport``, ``relay_fanout``: the rollout side's topology, which the trainer and the
    callbacks' ``RefitOptions`` do not know about)."""

    verify_dense: bool = True
    """Also publish a dense reference per version and have each receiver compare itself
    against it bit for bit (verification: costs dense bytes on the store)."""
    receiver_dump_dir: str = ""
    """Testing aid: each receiver writes every parameter and buffer after each applied
    version to ``<dir>/<receiver>/v<N>.safetensors`` ('' = off)."""
    transport: str = "store"
    """How the demo's receivers read the store: ``store``, each one directly; ``relay``,
    through a tree of ``nemo-dcr relay`` processes the demo starts over the store
    (``docs/relay.md``; the tree's shape: ``relay_fanout``).  The trainer writes the same
    store either way."""
    relay_fanout: int = 2
    """With ``transport=relay``: children (relays or receivers) per relay.  The receivers are
    the leaves, all at the same depth; each level above groups the one below in consecutive
    runs of this many, up to one root relay (4 receivers, fanout 2: 2 relays above them, 1
    root)."""

    late_receivers: int = 0
    """With ``membership=elastic``: receivers (``late0``, ``late1``, ...) the demo starts
    once version ``late_after`` is decided (and, with snapshots on, once the newest snapshot
    at or below it is complete, or 60 s later); each bootstraps from the store (that
    snapshot, else version 0), catches up, asks to join (``nemo-dcr receive --join``) and is
    admitted at a later version."""
    late_after: int = 2
    """With ``late_receivers``: the version whose decision starts them.  The test bed's
    trainer holds the step after the next one until they have asked to join, so the demo
    shows an admission however slow the machine is (a scenario aid; a real trainer never
    waits for a joiner)."""

    def late_receiver_ids(self) -> list[str]:
        """The ids of the ``late_receivers`` (``late0``, ``late1``, ...)."""
        return [f"late{i}" for i in range(self.late_receivers)]

    def __post_init__(self) -> None:
        super().__post_init__()  # checks every field's type, these two included
        if self.late_receivers < 0:
            raise ValueError(f"refit.late_receivers must be >= 0, got {self.late_receivers}")
        if self.late_receivers and self.membership != "elastic":
            raise ValueError("refit.late_receivers needs refit.membership=elastic (a static run admits no receiver)")
        if self.late_receivers and self.transport != "store":
            raise ValueError("refit.late_receivers reads the store directly: use refit.transport=store")
        if self.late_after < 1:
            raise ValueError(f"refit.late_after must be >= 1, got {self.late_after}")
        if self.transport not in TRANSPORTS:
            raise ValueError(f"refit.transport must be one of {TRANSPORTS}, got {self.transport!r}")
        if self.relay_fanout < 1:
            raise ValueError(f"refit.relay_fanout must be >= 1, got {self.relay_fanout}")
        if self.transport != "relay" and self.relay_fanout != 2:
            raise ValueError(f"refit.relay_fanout={self.relay_fanout} applies to refit.transport=relay only")
        if self.transport == "relay" and self.relay_fanout == 1 and len(self.receivers) > 1:
            raise ValueError(f"refit.relay_fanout=1 cannot join {len(self.receivers)} receivers under one root "
                             f"relay (a relay with one child never narrows the tree); use >= 2")


def _demo_refit() -> RefitConfig:
    """The values the schema leaves required (``demo.yaml`` sets the demo's other choices)."""
    return RefitConfig(model_id="demo", receivers=("r0",))


SERVE_RUNTIME = "vllm_serve"
"""``receiver.runtime`` of the demo's own: ``vllm serve`` engines with the backend (not a
``nemo-dcr receive`` runtime)."""

VLLM_HEAD_DIMS = (32, 64, 80, 96, 112, 128, 160, 192, 256)
"""Head sizes vLLM's CPU attention kernels take."""


@dataclass(kw_only=True)
class ReceiverRuntimeConfig:
    runtime: str = "hf"
    """Serving runtime each receiver keeps current: a runtime of ``nemo-dcr receive --runtime``
    (``hf``: a transformers model in the receiver process; ``vllm``: a ``vllm.LLM`` engine,
    CPU build), or ``vllm_serve``: each receiver a ``vllm serve`` engine with the nemo_dcr
    weight-transfer backend, refit by the controller with completions in flight (README,
    "Your own vLLM servers")."""
    tensor_parallel_size: int = 1
    """vLLM only: tensor-parallel workers of each receiver's engine."""
    sample_tokens: int = 8
    """vLLM only: greedy tokens each receiver generates after every refit, shown by the demo
    (0 = none)."""

    def __post_init__(self) -> None:
        # the registry's rows, names and options only: imports no runtime
        from nemo_dcr.receiver.registry import runtime_names, supported_options

        names = (*runtime_names(), SERVE_RUNTIME)
        if self.runtime not in names:
            raise ValueError(f"receiver.runtime must be one of {names}, got {self.runtime!r}")
        if self.tensor_parallel_size < 1 or self.sample_tokens < 0:
            raise ValueError("receiver.tensor_parallel_size must be >= 1 and receiver.sample_tokens >= 0")
        if self.runtime == SERVE_RUNTIME:
            return
        if self.tensor_parallel_size != 1 and "tensor_parallel_size" not in supported_options(self.runtime):
            takers = "|".join([*(n for n in runtime_names() if "tensor_parallel_size" in supported_options(n)),
                               SERVE_RUNTIME])
            raise ValueError(f"receiver.tensor_parallel_size applies to receiver.runtime={takers} only")


@dataclass(kw_only=True)
class DemoConfig:
    steps: int = 4
    """Optimizer steps; a refit follows every step."""
    run_dir: str = "runs/demo"
    """Logs, per-step stats (steps.jsonl) and the resolved config go here.  It must not
    exist or be empty (``demo.yaml`` picks a new ``runs/demo/<date-time>`` per run),
    so a run never overwrites the files of a previous one unless ``force=true``."""
    force: bool = False
    """Reuse a non-empty ``run_dir`` (overwriting its files) and empty a previous demo
    store at ``store.uri`` (as ``store.reset=true``)."""
    model: ModelConfig = field(default_factory=ModelConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    store: StoreConfig = field(default_factory=StoreConfig)
    refit: RefitConfig = field(default_factory=_demo_refit)
    receiver: ReceiverRuntimeConfig = field(default_factory=ReceiverRuntimeConfig)

    def __post_init__(self) -> None:
        if self.steps < 1:
            raise ValueError("steps must be >= 1")
        if self.refit.late_receivers and self.steps < self.refit.late_after + 2:
            raise ValueError(f"refit.late_receivers: steps={self.steps} leaves no version to admit them at (they start "
                             f"after version {self.refit.late_after}'s decision and are admitted two versions later: "
                             f"steps >= {self.refit.late_after + 2})")
        if "," in self.store.uri:
            raise ValueError(f"store.uri is the one store the trainer writes, not an upstream list: "
                             f"{self.store.uri!r} has a ','")
        if self.receiver.runtime == SERVE_RUNTIME:
            r = self.refit
            if r.membership != "static" or r.transport != "store":
                raise ValueError("receiver.runtime=vllm_serve: refit.membership=static and refit.transport=store only "
                                 "(elastic joins and relay trees are demonstrated with nemo-dcr receive)")
        if self.receiver.runtime in ("vllm", SERVE_RUNTIME):
            rt = self.receiver.runtime
            if self.model.head_dim not in VLLM_HEAD_DIMS:
                raise ValueError(f"receiver.runtime={rt}: vLLM's CPU attention takes head_dim in {VLLM_HEAD_DIMS}, "
                                 f"the model has hidden_size/num_attention_heads = {self.model.head_dim}")
            if self.model.family != "llama":
                raise ValueError(f"receiver.runtime={rt} is tested with model.family=llama only")
            tp = self.receiver.tensor_parallel_size
            if self.model.num_attention_heads % tp or self.model.num_query_groups % tp:
                raise ValueError(f"receiver.tensor_parallel_size={tp} must divide the model's query heads "
                                 f"({self.model.num_attention_heads}) and KV heads ({self.model.num_query_groups})")
        p = self.parallel
        self.model.check_parallel(
            tp=p.tensor_model_parallel_size, pp=p.pipeline_model_parallel_size,
            ep=p.expert_model_parallel_size,
            first_stage_layers=p.num_layers_in_first_pipeline_stage,
            last_stage_layers=p.num_layers_in_last_pipeline_stage,
        )

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "DemoConfig":
        """Strict: a key the schema does not have is an error naming it (a key left out
        takes the schema default)."""
        return build(cls, d)


def load_demo_config(overrides: list[str], *, config_dir: str | None = None, config_name: str = "demo") -> DemoConfig:
    """``<config_dir>/<config_name>.yaml`` (by default the packaged ``demo.yaml``) with Hydra
    overrides, as the validated dataclasses; any refusal is one :class:`ConfigError` line."""
    with ExitStack() as stack:
        if config_dir is None:
            config_dir = str(stack.enter_context(resources.as_file(resources.files(__package__) / "configs")))
        return load_config(DemoConfig, config_name, overrides, config_dir=config_dir)


# ------------------------------------------------------------------ help text (nemo-dcr demo --help)

def field_docs(cls) -> dict[str, str]:
    """Every field's doc of dataclass ``cls``: the string literal after it in the class body
    (of ``cls`` or the base that declares it), else its flag's help (``configs/flags.py``),
    else ''; whitespace folded."""
    from nemo_dcr.configs.flags import HELP

    docs: dict[str, str] = {}
    for klass in reversed(cls.__mro__):  # a subclass's own doc wins
        if not dataclasses.is_dataclass(klass) or klass is object:
            continue
        try:
            body = ast.parse(textwrap.dedent(inspect.getsource(klass))).body[0].body
        except (OSError, TypeError):  # no source (a frozen build): the flags' help only
            continue
        for node, nxt in zip(body, body[1:]):
            if (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and isinstance(nxt, ast.Expr)
                    and isinstance(nxt.value, ast.Constant) and isinstance(nxt.value.value, str)):
                docs[node.target.id] = " ".join(nxt.value.value.split())
    return {f.name: docs.get(f.name) or " ".join(f.metadata.get(HELP, "").split()) for f in dataclasses.fields(cls)}


def _type_name(tp) -> str:
    if isinstance(tp, type) and not typing.get_args(tp):
        return tp.__name__
    return str(tp).replace("typing.", "").replace("NoneType", "None")


def config_keys(cls=None, prefix: str = "", values: dict | None = None) -> list[tuple[str, str, object, str]]:
    """``(key, type, default, doc)`` of every leaf key of ``DemoConfig`` (dotted, in schema
    order); ``values``: what ``demo.yaml`` sets (unresolved: interpolations shown as written),
    else the schema default (a required field without either: ``MISSING``)."""
    cls = DemoConfig if cls is None else cls
    values = _demo_yaml() if values is None else values
    hints, docs, out = typing.get_type_hints(cls), field_docs(cls), []
    for f in dataclasses.fields(cls):
        key, tp = prefix + f.name, hints[f.name]
        if dataclasses.is_dataclass(tp):
            out += config_keys(tp, key + ".", values.get(f.name) or {})
            continue
        if f.name in values:
            default = values[f.name]
        elif f.default is not dataclasses.MISSING:
            default = f.default
        elif f.default_factory is not dataclasses.MISSING:
            default = f.default_factory()
        else:
            default = "MISSING"
        out.append((key, _type_name(tp), default, docs[f.name]))
    return out


def _demo_yaml() -> dict:
    """``demo.yaml``'s own values (its ``defaults`` list dropped), interpolations unresolved,
    with the ``refit`` values ``_demo_refit`` gives the fields the schema leaves required."""
    from omegaconf import OmegaConf

    with resources.as_file(resources.files(__package__) / "configs" / "demo.yaml") as path:
        raw = OmegaConf.to_container(OmegaConf.load(path), resolve=False)
    raw.pop("defaults", None)
    refit = _demo_refit()
    raw.setdefault("refit", {})
    for name in ("model_id", "receivers"):
        raw["refit"].setdefault(name, list(getattr(refit, name)) if name == "receivers" else getattr(refit, name))
    return raw


def _override_text(value) -> str:
    """``value`` as an override would write it."""
    if isinstance(value, bool):
        return str(value).lower()
    if value is None:
        return "null"
    if isinstance(value, (list, tuple)):
        return "[" + ",".join(_override_text(v) for v in value) + "]"
    return "''" if value == "" else str(value)


def config_help(prog: str = "nemo-dcr demo", width: int = 100) -> str:
    """The usage text of ``nemo-dcr demo --help``: every config key, its type, the demo's
    value and the key's doc."""
    head = f"""usage: {prog} [KEY=VALUE ...]

End-to-end refit demo: Megatron-Core trainer ranks (torchrun, gloo on CPU) publish a delta
after every optimizer step; receiver processes apply it in place and check themselves bit for
bit against a dense refit.  One table row per refit, then one JSON summary line on stdout;
progress and errors on stderr; logs, per-step records, the resolved config and the store
under run_dir.  Exit status: 0 when every refit was committed (and bit-exact with
refit.verify_dense), 1 for a failed run, 2 for bad input.

Overrides use Hydra's syntax: KEY=VALUE, e.g.
  {prog} steps=5 model.vocab_size=1003 refit.receivers=[r0,r1]
  {prog} refit.receivers=[r0,r1,r2,r3] refit.transport=relay refit.relay_fanout=2
A key not listed below, or a '+key=' addition, is refused.  The refit.* keys are the refit's
own settings (README, "Configuration of the refit") and the demo's verification and topology
aids; the others are the demo's.

Keys, as KEY (type) = the demo's value:
"""
    lines = [head]
    for key, tp, default, doc in config_keys():
        lines.append(f"  {key} ({tp}) = {_override_text(default)}\n")
        if doc:
            doc = doc.replace("``", "`")  # docstring markup: one backtick reads as code in a terminal
            lines.append(textwrap.fill(doc, width, initial_indent=" " * 6, subsequent_indent=" " * 6) + "\n")
    return "".join(lines)
