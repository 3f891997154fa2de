"""Fault campaign: randomized faults against the real refit pipeline, checked bit for bit.

The campaign is the test bed's package ``nemo_dcr_testbed.campaign`` (testbed/); its
docstring describes the classes and the checks (``--help`` prints it).

    .venv/bin/python scripts/fault_campaign.py --trials 500 --seed 0 \\
        --results benchmarks/results/fault_campaign.jsonl --out benchmarks/results/fault_campaign.json
"""
import sys

from nemo_dcr_testbed.campaign.cli import main

if __name__ == "__main__":
    sys.exit(main())
