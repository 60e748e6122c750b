"""Hypothesis settings for the whole suite.

``HYPOTHESIS_PROFILE=ci`` (set by ``.ci/run``) derandomizes the examples, so a CI run on
a clean clone draws the same examples each time: a red CI then names a bug in the
change, not a rare draw. Runs elsewhere keep drawing afresh, which is how new edge cases
are found. Neither profile has a deadline: example timings on a shared 2-core machine
are noise, and timings are benchmarks' business, not tests'.
"""

import os

from hypothesis import settings

settings.register_profile("dev", deadline=None)
settings.register_profile("ci", deadline=None, derandomize=True, print_blob=True)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "dev"))
