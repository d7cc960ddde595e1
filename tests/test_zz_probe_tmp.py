import time, psutil, os
from tests.test_faults import stack, workers, ORG, stage_runner, utcnow  # noqa

def test_probe(stack, workers):
    w = workers("f-probe")
    stack.wait_serving(w)
    for round in range(2):
        jid = stack.submit(f"{ORG}/tiny-llama")
        r = stage_runner(w, jid, "accelerator")
        t0 = time.monotonic()
        killed = False
        while time.monotonic() - t0 < 12:
            j = stack.job(jid)
            print(f"{time.monotonic()-t0:5.2f} now={utcnow():%H:%M:%S.%f} hb={j.heartbeat_at:%H:%M:%S.%f} {j.state} {j.lease_owner} att={j.attempts}")
            if not killed and time.monotonic() - t0 > 3:
                r.parent().kill(); killed = True; print("KILLED")
            time.sleep(0.5)
        stack.wait_final([jid])
        print(stack.job(jid).attempt_log)
