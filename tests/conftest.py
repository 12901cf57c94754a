import os
import sys

# Tests import helpers as `tests._dist`; ranks started by the harness need the same path.
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)
