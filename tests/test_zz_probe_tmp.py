import time, psutil, os
from tests.test_faults import *  # noqa
from tests.test_faults import stack, workers  # noqa

def sockets(pid):
    out = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            t = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if t.startswith("socket:"):
            out.add(t)
    return out

def test_probe(stack, workers):
    w = workers("f-probe")
    stack.wait_serving(w)
    time.sleep(3)
    main = psutil.Process(w.pid)
    kids = main.children()
    print("main", w.pid, "kids", [(k.pid, k.cmdline()[:3]) for k in kids])
    ms = sockets(w.pid)
    for k in kids:
        ks = sockets(k.pid)
        print("child", k.pid, "shared sockets", ms & ks)
    # db conns via proxy port
    for p in [main, *kids]:
        print(p.pid, [(c.laddr, c.raddr) for c in p.net_connections() if c.raddr and c.raddr.port == stack.db.port])
    kids[0].kill(); time.sleep(3)
    kids = main.children()
    ms = sockets(w.pid)
    for k in kids:
        ks = sockets(k.pid)
        print("new child", k.pid, "shared sockets", ms & ks)
    for p in [main, *kids]:
        print(p.pid, [(c.laddr, c.raddr) for c in p.net_connections() if c.raddr and c.raddr.port == stack.db.port])
