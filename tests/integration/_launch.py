"""Launch a worker script under torchrun (gloo, CPU) from a test, with a hard timeout."""
import os
import subprocess
import sys


def torchrun(script: str, nproc: int, *args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
           script, *args]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    if p.returncode != 0:
        raise AssertionError(f"{' '.join(cmd)} failed ({p.returncode}):\n{p.stdout[-4000:]}\n{p.stderr[-8000:]}")
    return p
