import sys

from services.prefill_worker.service import PrefillWorker

sys.exit(PrefillWorker.main(sys.argv[1:]))
