"""A stand-in for the `expecttest` package, which torch's test helpers import and this
environment lacks (nothing may be installed here). Only what `torch.testing._internal` needs:
a `TestCase` base with `assertExpectedInline`, compared exactly (no accepting of new output)."""

import unittest

ACCEPT = False


class TestCase(unittest.TestCase):
    longMessage = True

    def assertExpectedInline(self, actual, expect, skip=0):  # noqa: N802 (the package's name)
        self.assertEqual(str(actual).strip(), str(expect).strip())

    def assertExpectedRaisesInline(self, exc_type, callable, expect, *args, **kwargs):  # noqa: N802
        with self.assertRaises(exc_type) as ctx:
            callable(*args, **kwargs)
        self.assertExpectedInline(str(ctx.exception), expect)
