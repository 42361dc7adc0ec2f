"""Lets ``test_trainer.py`` import ``trainer`` when pytest imports test files without
putting their folder on ``sys.path`` (gradaccum's own ``--import-mode=importlib``)."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
