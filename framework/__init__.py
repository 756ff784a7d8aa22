"""A configuration-driven training framework built around a fully sharded data-parallel engine."""

import logging as _logging

# torchao (float8 training; transformers imports it too once it is installed) reports at import
# the GPU kernels a CPU build cannot load and registers enums torch's pytree now handles itself:
# nothing a user can act on, and on every rank of every job. Its errors still show.
_logging.getLogger("torchao").setLevel(_logging.ERROR)


class _DropEnumRegistrationNotice(_logging.Filter):
    def filter(self, record: _logging.LogRecord) -> bool:
        return "is an Enum subclass and is now natively supported" not in record.getMessage()


_logging.getLogger("torch.utils._pytree").addFilter(_DropEnumRegistrationNotice())
