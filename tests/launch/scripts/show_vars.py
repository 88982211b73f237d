"""A rank that prints ``VARS {json}``: the values of the variables named in argv."""

import json
import os
import sys

print("VARS " + json.dumps({name: os.environ.get(name) for name in sys.argv[1:]}))
