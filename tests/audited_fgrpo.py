"""``fgrpo`` with every file it opens checked (tests/_helpers.OpenAudit): run as
``python tests/audited_fgrpo.py COMMAND ...`` with FGRPO_FORBIDDEN (a folder) and
FGRPO_FORBIDDEN_LOG (a file); each path under the folder that the command opens or lists is
appended to the log, one a line. The property test of issue 22 runs compose this way."""

import os
import sys

from _helpers import OpenAudit

OpenAudit.forbidden = os.path.realpath(os.environ["FGRPO_FORBIDDEN"])
OpenAudit.log = os.environ["FGRPO_FORBIDDEN_LOG"]
OpenAudit.install()

from fgrpo.core.cli import main  # noqa: E402 - after the audit is installed: fgrpo's own opens are audited

sys.exit(main())
