"""``scripts/fault_campaign.py`` loaded as a module (it is a script, not part of the package)."""
import importlib.util
import os

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def load_campaign():
    spec = importlib.util.spec_from_file_location("fault_campaign", os.path.join(ROOT, "scripts", "fault_campaign.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod
