"""A script whose process outlives its last line: a non-daemon thread that never ends keeps the
interpreter from exiting, as Paddle's or gloo's teardown did after a failed collective."""

import sys
import threading

import paddle.distributed as dist

dist.init_parallel_env()
threading.Thread(target=threading.Event().wait).start()  # joined at interpreter exit: forever
print("done", dist.get_rank(), flush=True)
sys.exit(3 if "--fail" in sys.argv else 0)
