"""torchrun worker (2 ranks, TP=2) for test_bridge_callback.py: a Megatron-Bridge job that
ends on an exit condition.

Usage: torchrun --nproc-per-node 2 bridge_exit_worker.py --store S --dense D --iters N
       --exit-after E [--no-exit-settle]

``RefitBridgeCallback`` registered through Bridge 0.6.2's own ``callbacks.py`` and fired in
its ``train.py`` order (``testbed/nemo_dcr_testbed/bridge_loop.py``), with ``train_iters=N`` and an
exit condition met after iteration E (``exit_interval`` / ``exit_duration_in_mins`` / a
signal): the loop breaks and calls ``sys.exit(0)`` BEFORE ``on_train_end``, so nothing
drains the pipelined refit's last version E -- only the refit's exit settle
(``RefitSender.settle_on_exit``, at interpreter exit).  ``--no-exit-settle`` switches that
off (``sender._SETTLE_ON_EXIT``, private): the control.  After every published iteration the
dense reference is written to D/v<version>.safetensors (``callback_worker.write_reference``).
"""
import argparse

import torch.distributed as dist

from callback_worker import build, write_reference


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--store", required=True)
    p.add_argument("--dense", required=True)
    p.add_argument("--iters", type=int, required=True)
    p.add_argument("--exit-after", type=int, required=True)
    p.add_argument("--no-exit-settle", action="store_true")
    args = p.parse_args()
    from nemo_dcr.sender import inflight as sender_mod
    from nemo_dcr.integrations.bridge import RefitBridgeCallback
    from nemo_dcr_testbed import bridge_loop, bridge_release

    if args.no_exit_settle:
        sender_mod._SETTLE_ON_EXIT = False
    cfg, trainer, model = build("bridge")
    bridge = bridge_release.load()
    callback = RefitBridgeCallback(overrides=[
        f"refit.store_uri={args.store}", "refit.model_id=cb", "refit.receivers=[r0]",
        f"refit.vocab_size={cfg.vocab_size}", "refit.ack_timeout_s=300"])
    state = bridge_loop.GlobalState()

    def step_fn(iteration: int) -> bridge_loop.Iteration:
        r = trainer.train_step()
        return bridge_loop.Iteration(loss_dict={}, grad_norm=r.grad_norm, skipped=not r.update_successful)

    def after_step_end(iteration: int, result: bridge_loop.Iteration) -> None:
        assert not result.skipped
        write_reference(callback, trainer, iteration, args.dense, check_layers=False)
        if iteration == args.exit_after and dist.get_rank() == 0:
            print(f"worker: exit condition after iteration {iteration}; version {iteration} in flight "
                  f"(decided: {callback.last_metrics.version if callback.last_metrics else None})", flush=True)

    bridge_loop.train(bridge=bridge, callbacks=[callback], state=state, model=model, optimizer=trainer.optimizer,
                      train_iters=args.iters, step_fn=step_fn, after_step_end=after_step_end,
                      exit_after=args.exit_after)
    print("worker: on_train_end fired", flush=True)  # never: the exit condition calls sys.exit first


if __name__ == "__main__":
    main()
