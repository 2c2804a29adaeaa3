import sys

from services.decode_worker.service import DecodeWorker

sys.exit(DecodeWorker.main(sys.argv[1:]))
