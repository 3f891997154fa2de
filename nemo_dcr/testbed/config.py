"""Configuration of the end-to-end job: keyword-only dataclasses are the schema, Hydra
(``configs/*.yaml`` + command-line overrides) is only the edge.

``load_demo_config(overrides)`` composes ``configs/demo.yaml`` with Hydra's override
grammar (``model.vocab_size=1003``, ``steps=5``), then merges the result into the typed
schema: unknown keys (``model.famly=...`` as well as Hydra's ``+key=`` / ``++key=``
additions) and wrong types are errors, and every dataclass's ``__post_init__`` validates
its values.  :func:`describe_config_error` turns any of these into one line.
"""
from __future__ import annotations

import difflib
import os
import re
import typing
from dataclasses import asdict, dataclass, field, fields, is_dataclass

from nemo_dcr.testbed.model import ModelConfig
from nemo_dcr.testbed.train import TrainConfig

CONFIG_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "configs")


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


@dataclass(kw_only=True)
class RefitConfig:
    receivers: int = 1
    """Receiver processes; the joint commit waits for all of them."""
    chunk_bytes: int = 1 << 20
    """Upper bound on a chunk's raw records (positions + values) before coding; large
    tensors are split, so chunks stream while later layers are diffed."""
    context: bool = True
    """Context-mode coding (conditioned on the base bits receivers hold) where the trainer
    rank holds a record's whole canonical base; see docs/design.md."""
    upload_workers: int = 2
    """Encode/upload threads per trainer rank (overlap with diffing later layers)."""
    ack_timeout_s: float = 300.0
    """How long the trainer waits for every receiver's acknowledgement."""
    verify_dense: bool = True
    """Also publish a dense reference per version and have each receiver compare itself
    against it bit for bit (verification: costs dense bytes on the store)."""
    receiver_dump_dir: str = ""
    """Testing aid: each receiver writes every parameter and buffer after each applied
    version to ``<dir>/<receiver>/v<N>.safetensors`` ('' = off)."""

    def __post_init__(self) -> None:
        if self.receivers < 1 or self.chunk_bytes < 1 or self.upload_workers < 1 or self.ack_timeout_s <= 0:
            raise ValueError("refit: receivers, chunk_bytes, upload_workers must be >= 1, ack_timeout_s > 0")


RUNTIMES = ("hf", "vllm")
VLLM_HEAD_DIMS = (32, 64, 80, 96, 112, 128, 160, 192, 256)
"""Head sizes vLLM's CPU attention kernels take."""


@dataclass(kw_only=True)
class ReceiverRuntimeConfig:
    runtime: str = "hf"
    """Serving runtime each receiver keeps current: ``hf`` (a transformers model in the
    receiver process) or ``vllm`` (a ``vllm.LLM`` engine, CPU build)."""
    tensor_parallel_size: int = 1
    """vLLM only: tensor-parallel workers of each receiver's engine."""
    sample_tokens: int = 8
    """vLLM only: greedy tokens each receiver generates after every refit, shown by the demo
    (0 = none)."""

    def __post_init__(self) -> None:
        if self.runtime not in RUNTIMES:
            raise ValueError(f"receiver.runtime must be one of {RUNTIMES}, got {self.runtime!r}")
        if self.tensor_parallel_size < 1 or self.sample_tokens < 0:
            raise ValueError("receiver.tensor_parallel_size must be >= 1 and receiver.sample_tokens >= 0")
        if self.runtime == "hf" and self.tensor_parallel_size != 1:
            raise ValueError("receiver.tensor_parallel_size applies to receiver.runtime=vllm only")


@dataclass(kw_only=True)
class DemoConfig:
    steps: int = 4
    """Optimizer steps; a refit follows every step."""
    model_id: str = "demo"
    """Lineage name carried by manifests and chunks."""
    run_dir: str = "runs/demo"
    """Logs, per-step stats (steps.jsonl) and the resolved config go here.  It must not
    exist or be empty (``configs/demo.yaml`` picks a new ``runs/demo/<date-time>`` per run),
    so a run never overwrites the files of a previous one unless ``force=true``."""
    force: bool = False
    """Reuse a non-empty ``run_dir`` (overwriting its files) and empty a previous demo
    store at ``store.uri`` (as ``store.reset=true``)."""
    model: ModelConfig = field(default_factory=ModelConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    store: StoreConfig = field(default_factory=StoreConfig)
    refit: RefitConfig = field(default_factory=RefitConfig)
    receiver: ReceiverRuntimeConfig = field(default_factory=ReceiverRuntimeConfig)

    def __post_init__(self) -> None:
        if self.steps < 1:
            raise ValueError("steps must be >= 1")
        if self.receiver.runtime == "vllm":
            if self.model.head_dim not in VLLM_HEAD_DIMS:
                raise ValueError(f"receiver.runtime=vllm: vLLM's CPU attention takes head_dim in {VLLM_HEAD_DIMS}, "
                                 f"the model has hidden_size/num_attention_heads = {self.model.head_dim}")
            if self.model.family != "llama":
                raise ValueError("receiver.runtime=vllm is tested with model.family=llama only")
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
        return _build(cls, d, "")


def _field_types(cls) -> dict[str, object]:
    try:
        return typing.get_type_hints(cls)
    except Exception:  # noqa: BLE001 - an annotation that does not resolve: treat fields as leaves
        return {}


def _unknown_key(path: str, name: str, cls) -> ValueError:
    full = f"{path}.{name}" if path else name
    close = difflib.get_close_matches(name, [f.name for f in fields(cls)], n=1)
    hint = f"; did you mean {(f'{path}.' if path else '') + close[0]!r}?" if close else ""
    return ValueError(f"unknown config key {full!r} ({cls.__name__} has no field {name!r}{hint})")


def _build(cls, d, path: str):
    if not isinstance(d, dict):
        raise ValueError(f"config key {path!r} must be a mapping of {cls.__name__} fields, got {d!r}")
    names = {f.name for f in fields(cls)}
    for name in d:
        if name not in names:
            raise _unknown_key(path, name, cls)
    types = _field_types(cls)
    kwargs = {}
    for name, value in d.items():
        sub = types.get(name)
        full = f"{path}.{name}" if path else name
        kwargs[name] = _build(sub, value, full) if isinstance(sub, type) and is_dataclass(sub) else value
    return cls(**kwargs)


def check_override_keys(overrides: list[str], schema=None) -> None:
    """Refuse an override whose key the schema does not have, before Hydra composes:
    ``model.famly=x``, ``+model.famly=x``, ``++colour=red`` and ``~model.famly`` all name a
    key that does not exist (Hydra would accept the additions and drop or pass them on)."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    schema = schema or DemoConfig
    parser = OverridesParser.create()
    for line in overrides:
        try:
            (o,) = parser.parse_overrides([line])
        except Exception as e:  # noqa: BLE001 - Hydra's parse errors: name the override
            raise ValueError(f"override {line!r} does not parse: {describe_config_error(e)}") from None
        if o.package is not None:
            raise ValueError(f"override {o.input_line!r}: package overrides (key@package) are not supported")
        cls, path = schema, ""
        for name in o.key_or_group.split("."):
            if not (isinstance(cls, type) and is_dataclass(cls)):
                raise ValueError(f"override {o.input_line!r}: {path!r} is a value, it has no key {name!r}")
            if name not in {f.name for f in fields(cls)}:
                raise _unknown_key(path, name, cls)
            cls, path = _field_types(cls).get(name), f"{path}.{name}" if path else name


def describe_config_error(e: BaseException) -> str:
    """One line for a configuration error: the message and its causes (Hydra puts the
    reason a value was refused in ``__cause__``), whitespace collapsed."""
    parts: list[str] = []
    seen: set[int] = set()
    cur: BaseException | None = e
    while cur is not None and id(cur) not in seen and len(parts) < 4:
        seen.add(id(cur))
        text = " ".join(str(cur).split())
        text = re.sub(r"\s*See https://hydra\.cc/\S+ for details\.?", "", text)
        if text and not any(text in p for p in parts):
            parts.append(text)
        cur = cur.__cause__
    return ": ".join(parts) or type(e).__name__


def _writable(node) -> None:
    from omegaconf import DictConfig, OmegaConf

    OmegaConf.set_readonly(node, False)
    if isinstance(node, DictConfig):
        for k in node:
            child = node._get_node(k)
            if isinstance(child, DictConfig):
                _writable(child)


SCHEMA_NAME = "nemo_dcr_demo_schema"


def _register_schema() -> None:
    from hydra.core.config_store import ConfigStore
    from omegaconf import OmegaConf

    schema = OmegaConf.structured(DemoConfig)
    _writable(schema)  # frozen dataclasses make read-only nodes; overrides must write them
    ConfigStore.instance().store(name=SCHEMA_NAME, node=schema)


def load_demo_config(overrides: list[str], *, config_dir: str = CONFIG_DIR, config_name: str = "demo") -> DemoConfig:
    """Compose ``<config_dir>/<config_name>.yaml`` (whose defaults list starts with the
    typed schema) with Hydra overrides, and build the validated dataclasses."""
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    check_override_keys(overrides)
    _register_schema()
    with initialize_config_dir(config_dir=os.path.abspath(config_dir), version_base="1.3"):
        composed = compose(config_name=config_name, overrides=list(overrides))
    try:
        return DemoConfig.from_dict(OmegaConf.to_container(composed, resolve=True))
    except ValueError as e:
        if str(e).startswith("unknown config key"):  # overrides were checked: it is in the file
            raise ValueError(f"{os.path.join(config_dir, config_name)}.yaml: {e}") from None
        raise
