"""Op tests reuse the memory tests' graph walk and the helpers one directory up."""

import os
import sys

_TESTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
for _path in (os.path.join(_TESTS, "memory"), _TESTS):
    if _path not in sys.path:
        sys.path.insert(0, _path)
