"""`python -m services.scheduler [--flags]`: settings from MOEMESH_SCHEDULER_* env vars and flags."""

from services.scheduler.service import SchedulerService

raise SystemExit(SchedulerService.main())
