import os
import sys

# The multi-process harness spawns ranks that import test modules by name; the example model
# lives in examples/.
_here = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, _here)
sys.path.insert(0, os.path.join(os.path.dirname(_here), "examples"))
