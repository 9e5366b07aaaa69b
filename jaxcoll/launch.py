"""``python -m jaxcoll.launch``: the command of :mod:`jaxcoll.runtime.launch`.

Kept at this path because it is the documented command; the code lives in
:mod:`jaxcoll.runtime.launch` (``import jaxcoll.launch`` gives its names too).
"""

import sys

from jaxcoll.runtime.launch import *  # noqa: F403
from jaxcoll.runtime.launch import main

if __name__ == "__main__":
  sys.exit(main())
