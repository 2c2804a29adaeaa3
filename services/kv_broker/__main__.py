"""`python -m services.kv_broker [--flags]`: settings from MOEMESH_KV_BROKER_* env vars and flags."""

from services.kv_broker.service import KvBroker

raise SystemExit(KvBroker.main())
