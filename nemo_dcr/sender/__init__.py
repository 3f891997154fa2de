"""The trainer side of a refit: diff -> project -> encode -> upload on every rank, streaming,
then rank 0's joint commit.  One module per role:

=================  ===================================================================
``engine``         :class:`RefitSender`: claim, submit / settle / finish, the background work
``chunker``        the diff -> project -> records -> chunks loop of one rank
``decision``       rank 0: totals, manifest, acks, decision record, the refusal policy
``inflight``       the version in flight, and its bounded settle at exit / SIGTERM
``snapshots``      committed-version snapshots for late joiners
``feedback``       ``refit.coding=auto``: measurements in, the next coding out
``coding_choice``  the codings table and the ``auto`` chooser's model
``collectives``    rank helpers and the object collectives
``options``        :class:`RefitOptions`, the refit schema
``stats``          :class:`PublishStats` and the records that cross ranks
=================  ===================================================================

The framework front ends (NeMo, Megatron-Bridge, the Megatron hook, ``attach``) are in
``nemo_dcr/integrations/``; they build a :class:`RefitSender` and call it.
"""
from nemo_dcr.sender.engine import ReceiverRefused, RefitSender
from nemo_dcr.sender.inflight import exit_settle_bound_s
from nemo_dcr.sender.options import RefitOptions, RefitSetupError
from nemo_dcr.sender.stats import PublishStats

__all__ = ["PublishStats", "ReceiverRefused", "RefitOptions", "RefitSender", "RefitSetupError",
           "exit_settle_bound_s"]
