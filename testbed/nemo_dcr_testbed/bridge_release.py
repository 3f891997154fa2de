"""Megatron-Bridge's own callback machinery, from its released wheel, for the conformance tests.

``megatron/bridge/training/callbacks.py`` (``CallbackContext``, ``Callback``,
``CallbackManager``, ``normalize_callbacks``, ``should_fire``) imports only the standard
library, so it loads on any Python even though ``import megatron.bridge`` cannot run here
(it imports Transformer Engine's torch binding, which builds only against CUDA).  It is
taken from the wheel of the release the tests pin, never from a copy in this repository:

* ``fetch()`` runs ``pip download --no-deps --only-binary=:all: --python-version 3.12
  megatron-bridge==0.6.2`` (the wheel needs Python 3.12; ``--python-version`` lets pip on
  3.11 fetch it) with the wheel's sha256 required, extracts only ``callbacks.py`` into
  ``.cache/megatron-bridge-0.6.2/`` and drops the wheel.  ``make setup`` runs it
  (``python -m nemo_dcr_testbed.bridge_release``); ``load()`` runs it when the cache is
  empty.
* ``load()`` checks the extracted file's sha256 (pinned as well), then imports it under a
  private module name, so nothing named ``megatron.bridge`` appears in ``sys.modules``.
"""
from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile

from nemo_dcr.protocol.version0 import sha256_file

BRIDGE_VERSION = "0.6.2"
WHEEL = f"megatron_bridge-{BRIDGE_VERSION}-py3-none-any.whl"
WHEEL_SHA256 = "bcb7274ab9327167c345aa24b96b95790ce5090df1945d883bdc41065d5649e2"
MEMBER = "megatron/bridge/training/callbacks.py"
MEMBER_SHA256 = "7f3f8a7a72c854a698948e4ccd0012f1c7e615864f7a0feecffc270a11d1d8eb"
# the checkout: this file is <checkout>/testbed/nemo_dcr_testbed/bridge_release.py
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
CACHE_DIR = os.path.join(ROOT, ".cache", f"megatron-bridge-{BRIDGE_VERSION}")
MODULE_NAME = "_nemo_dcr_bridge_callbacks_" + BRIDGE_VERSION.replace(".", "_")


class BridgeReleaseError(RuntimeError):
    """The pinned Bridge release could not be fetched, or its bytes are not the pinned ones."""


def _sha256(path: str) -> str:
    return sha256_file(path).removeprefix("sha256:")


def fetch(cache_dir: str = CACHE_DIR) -> str:
    """Path of the release's ``callbacks.py`` in ``cache_dir``, downloading it first if absent."""
    target = os.path.join(cache_dir, "callbacks.py")
    if os.path.exists(target):
        return target
    os.makedirs(cache_dir, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=cache_dir) as tmp:
        req = os.path.join(tmp, "requirements.txt")
        with open(req, "w") as f:
            f.write(f"megatron-bridge=={BRIDGE_VERSION} --hash=sha256:{WHEEL_SHA256}\n")
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--python-version",
               "3.12", "--require-hashes", "-r", req, "-d", tmp, "-q"]
        p = subprocess.run(cmd, capture_output=True, text=True)
        wheel = os.path.join(tmp, WHEEL)
        if p.returncode != 0 or not os.path.exists(wheel):
            raise BridgeReleaseError(f"{' '.join(cmd)} failed ({p.returncode}): {p.stderr.strip()[-2000:]}")
        if _sha256(wheel) != WHEEL_SHA256:
            raise BridgeReleaseError(f"{WHEEL}: sha256 {_sha256(wheel)}, pinned {WHEEL_SHA256}")
        with zipfile.ZipFile(wheel) as z, z.open(MEMBER) as src, open(os.path.join(tmp, "callbacks.py"), "wb") as out:
            shutil.copyfileobj(src, out)
        os.replace(os.path.join(tmp, "callbacks.py"), target)
    return target


def load(cache_dir: str = CACHE_DIR):
    """Bridge's ``callbacks`` module (fetched if needed, its sha256 checked), imported under
    :data:`MODULE_NAME`."""
    path = fetch(cache_dir)
    got = _sha256(path)
    if got != MEMBER_SHA256:
        raise BridgeReleaseError(f"{path}: sha256 {got}, pinned {MEMBER_SHA256} (delete it to fetch it again)")
    if MODULE_NAME in sys.modules:
        return sys.modules[MODULE_NAME]
    spec = importlib.util.spec_from_file_location(MODULE_NAME, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[MODULE_NAME] = module  # dataclasses resolve the module by name while the class is built
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[MODULE_NAME]
        raise
    return module


if __name__ == "__main__":
    print(fetch())
