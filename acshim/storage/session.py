"""Former name of ``acshim.storage.offload_session`` (the offload session: one scope's pack/unpack
pair). Both names are the same module object, so attributes set on either are seen by both."""

import sys

from . import offload_session

sys.modules[__name__] = offload_session
