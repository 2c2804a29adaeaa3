"""`python -m services.gateway`: settings from MOEMESH_GATEWAY_* env vars and --flags."""

import sys

from services.gateway.service import Gateway

sys.exit(Gateway.main())
