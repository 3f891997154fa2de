"""Receiver loop: wait for the next manifest, check it, apply it in place, acknowledge.

Order of checks for version ``v`` (nothing is written until all of them passed):

1. the manifest parses strictly and names this model;
2. its ``base_version`` is the version this receiver holds (else: refusal, no download);
3. every chunk downloads with the listed size and sha256 digest;
4. every chunk decodes (strict decoder) and its own header agrees with the manifest;
5. the apply engine validates every delta against the runtime's tensor specs.

Then the deltas are applied through the runtime's loader, the version advances and an
ack is written.  A failure at steps 1-5 writes a refusal ack naming the chunk and the
reason; the weights are untouched and the receiver keeps waiting for a version whose base
it holds.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

from nemo_dcr.codec import ChunkFormatError, chunk_digest, decode_chunk, read_chunk_index
from nemo_dcr.codec.types import TensorDelta
from nemo_dcr.protocol.manifest import (
    Ack,
    Manifest,
    ManifestError,
    ack_key,
    check_receiver_id,
    dense_key,
    manifest_key,
)
from nemo_dcr.transport.store import ObjectStore, open_store
from nemo_dcr.errors import ProtocolError


class RefitRefused(ProtocolError):
    """A version this receiver will not apply; the message names the chunk and reason."""


class _HeldBits(Mapping):
    """Context-mode base for the decoder: the canonical bits the runtime holds now (the
    version being applied is the base of), fetched on first use per tensor.  Valid only
    until the first write, which is why every chunk is decoded before any apply."""

    def __init__(self, served):
        self._served = served
        self._names = frozenset(served.tensor_specs())
        self._cache: dict[str, np.ndarray] = {}

    def __getitem__(self, name: str) -> np.ndarray:
        if name not in self._names:
            raise KeyError(name)
        if name not in self._cache:
            self._cache[name] = self._served.canonical_bits(name)
        return self._cache[name]

    def __contains__(self, name: object) -> bool:
        return name in self._names

    def __iter__(self):
        return iter(self._names)

    def __len__(self) -> int:
        return len(self._names)


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

    def __post_init__(self) -> None:
        check_receiver_id(self.receiver_id)
        if self.poll_s <= 0:
            raise ValueError("poll_s must be positive")


class Receiver:
    def __init__(self, applier, store: ObjectStore, cfg: ReceiverConfig, *, held_version: int = 0,
                 reference=None):
        """``applier``: a ``ServedModel`` (``receiver/served.py``), or a prewarmed
        ``DeltaApplier`` with ``reference``, a second runtime adapter used by
        ``verify_dense`` (they are wrapped in an ``InProcessModel``)."""
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
        self.on_applied = None  # optional fn(version), called after each applied version

    # --------------------------------------------------------------- one version
    def fetch(self, manifest: Manifest) -> tuple[list[TensorDelta], dict]:
        """Steps 2-4: download, verify and decode every chunk; raises RefitRefused."""
        if manifest.model_id != self.cfg.model_id:
            raise RefitRefused(f"manifest v{manifest.version} is for model {manifest.model_id!r}, "
                               f"this receiver serves {self.cfg.model_id!r}")
        if manifest.base_version != self.held_version:
            raise RefitRefused(f"manifest v{manifest.version} has base version {manifest.base_version}, "
                               f"this receiver holds version {self.held_version}")
        t0 = time.perf_counter()
        blobs = []
        for ref in manifest.chunks:
            try:
                blob = self.store.get(ref.key)
            except KeyError as e:
                raise RefitRefused(f"chunk {ref.key}: missing from the store ({e})") from None
            if len(blob) != ref.nbytes:
                raise RefitRefused(f"chunk {ref.key}: {len(blob)} bytes, manifest says {ref.nbytes}")
            if chunk_digest(blob) != ref.digest:
                raise RefitRefused(f"chunk {ref.key}: digest mismatch (corrupt or tampered)")
            blobs.append((ref, blob))
        t1 = time.perf_counter()
        deltas: list[TensorDelta] = []
        held = _HeldBits(self.served)
        want = {"model_id": manifest.model_id, "version": str(manifest.version),
                "base_version": str(manifest.base_version)}
        for ref, blob in blobs:
            try:
                # the header first: a chunk of another version must not even be decoded
                got = {k: read_chunk_index(blob).meta.get(k) for k in want}
                if got != want:
                    raise RefitRefused(f"chunk {ref.key}: header {got} disagrees with manifest {want}")
                chunk = decode_chunk(blob, base=held)
            except ChunkFormatError as e:
                raise RefitRefused(f"chunk {ref.key}: {e}") from None
            deltas.extend(chunk.deltas)
        t2 = time.perf_counter()
        return deltas, {"download_s": t1 - t0, "decode_s": t2 - t1,
                        "wire_bytes": manifest.wire_bytes, "changed": sum(d.nnz for d in deltas)}

    def apply_manifest(self, manifest: Manifest) -> Ack:
        try:
            deltas, stats = self.fetch(manifest)
            t0 = time.perf_counter()
            self.served.apply(deltas)  # validates everything before the first write
            stats["apply_s"] = time.perf_counter() - t0
        except (RefitRefused, ValueError) as e:
            return Ack(receiver=self.cfg.receiver_id, version=manifest.version, ok=False,
                       held_version=self.held_version, error=str(e))
        self.held_version = manifest.version
        if self.on_applied is not None:
            self.on_applied(manifest.version)
        if self.cfg.verify_dense:
            stats.update(self.verify_against_dense(manifest.version))
        sample = self.served.sample()
        if sample is not None:
            stats["sample"] = sample
        return Ack(receiver=self.cfg.receiver_id, version=manifest.version, ok=True,
                   held_version=self.held_version, stats=stats)

    def verify_against_dense(self, version: int) -> dict:
        from safetensors.torch import load as load_safetensors

        t0 = time.perf_counter()
        dense = load_safetensors(self.store.get(dense_key(version)))
        report = self.served.verify_dense(dense)
        return {**report, "verify_s": time.perf_counter() - t0}

    # --------------------------------------------------------------- loop
    def run(self, *, until_version: int | None = None, timeout_s: float | None = None,
            log=print) -> int:
        """Serve versions ``held+1, held+2, ...`` until ``until_version`` is handled.
        ``timeout_s`` bounds the wait for each next manifest.  Returns the version held."""
        nxt = self.held_version + 1
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while until_version is None or nxt <= until_version:
            key = manifest_key(nxt)
            if not self.store.exists(key):
                if deadline is not None and time.monotonic() > deadline:
                    raise TimeoutError(f"receiver {self.cfg.receiver_id}: no manifest v{nxt} in {timeout_s}s")
                time.sleep(self.cfg.poll_s)
                continue
            try:
                manifest = Manifest.from_json(self.store.get(key))
            except ManifestError as e:
                ack = Ack(receiver=self.cfg.receiver_id, version=nxt, ok=False,
                          held_version=self.held_version, error=f"{key}: {e}")
            else:
                ack = self.apply_manifest(manifest)
            self.store.put(ack_key(self.cfg.receiver_id, nxt), ack.to_json())
            log(json.dumps({"receiver": self.cfg.receiver_id, "version": nxt, "ok": ack.ok,
                            "held": ack.held_version, "error": ack.error, **ack.stats}), flush=True)
            nxt += 1
            deadline = None if timeout_s is None else time.monotonic() + timeout_s
        return self.held_version


def main(argv: list[str] | None = None) -> int:
    """``nemo-dcr receive`` / ``python -m nemo_dcr.receiver.worker``: a receiver keeping a
    transformers model or a vLLM engine at the versions a store publishes."""
    ap = argparse.ArgumentParser(prog="nemo-dcr receive")
    ap.add_argument("--store", required=True, help="store URI (directory or fsspec URI)")
    ap.add_argument("--receiver-id", required=True)
    ap.add_argument("--model-id", required=True)
    ap.add_argument("--until-version", type=int, default=None)
    ap.add_argument("--timeout-s", type=float, default=None,
                    help="give up when no next manifest appears for this long (default: wait forever)")
    ap.add_argument("--verify-dense", action="store_true")
    ap.add_argument("--init-dir", required=True, help="local directory with the initial HF checkpoint")
    ap.add_argument("--runtime", choices=("hf", "vllm"), default="hf",
                    help="serving runtime kept current: a transformers model in this process, or a vllm.LLM engine")
    ap.add_argument("--tensor-parallel-size", type=int, default=1, help="vLLM only: TP workers of the engine")
    ap.add_argument("--max-model-len", type=int, default=None, help="vLLM only: the engine's context length")
    ap.add_argument("--sample-tokens", type=int, default=0,
                    help="vLLM only: greedy tokens generated after every refit and reported in the ack")
    ap.add_argument("--dump-dir", default=None,
                    help="testing aid: after each applied version write every parameter and buffer "
                         "to DIR/v<version>.safetensors")
    args = ap.parse_args(argv)

    store = open_store(args.store)
    cfg = ReceiverConfig(receiver_id=args.receiver_id, model_id=args.model_id, verify_dense=args.verify_dense)
    if args.runtime == "vllm":
        from nemo_dcr.runtimes.vllm.served import VLLMServedModel

        served = VLLMServedModel.start(args.init_dir, tensor_parallel_size=args.tensor_parallel_size,
                                       max_model_len=args.max_model_len, reference=args.verify_dense,
                                       sample_tokens=args.sample_tokens)
        rx = Receiver(served, store, cfg)
        if args.dump_dir:
            rx.on_applied = lambda version: served.dump(args.dump_dir, version)
    else:
        from nemo_dcr.receiver.apply import DeltaApplier
        from nemo_dcr.runtimes.hf import HFTransformersAdapter

        adapter = HFTransformersAdapter.from_pretrained(args.init_dir)
        applier = DeltaApplier(adapter)
        applier.prewarm()
        reference = HFTransformersAdapter.from_pretrained(args.init_dir) if args.verify_dense else None
        rx = Receiver(applier, store, cfg, reference=reference)
        if args.dump_dir:
            rx.on_applied = lambda version: dump_state(adapter.module, args.dump_dir, version)
    print(json.dumps({"receiver": args.receiver_id, "ready": True}), flush=True)
    try:
        rx.run(until_version=args.until_version, timeout_s=args.timeout_s)
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
