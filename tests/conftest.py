import os
import sys

# The multi-process harness spawns ranks that import test modules by name.
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
