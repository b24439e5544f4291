"""Tessera's configuration, in the order a run uses it: errors.py (``ConfigError`` and the checks that name a
field), schema.py (the typed sections), loading.py (TOML, command line, ``--help``, dump) and validation.py
(the cross-field rules, returning the resolved ``Plan``; it needs the models, so this package does not import it).
"""

from engine.config.errors import *  # noqa: F401,F403
from engine.config.loading import *  # noqa: F401,F403
from engine.config.schema import *  # noqa: F401,F403
