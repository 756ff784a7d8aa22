"""The small image classifier of the digits recipe (`experiment=digits_cnn`)."""
from framework.models.cnn.model import DigitsCNN  # noqa: F401
