"""Stand-in CUDA streams for the pipeline's fork / join paths on the interpreter (which has none): each wait, each
event and the stream each stage launches on go to a log the test compares with the order it expects."""

import contextlib


def stand_in_streams(monkeypatch, pipeline, log, *, caller_on_side=False):
    """Patch `pipeline` (kernels/triton/pipeline.py) to run on three named stand-ins, main, side and second, logging
    "X waits Y", "X records", "X waits Y's event". caller_on_side: the caller already runs on the pipeline's side
    stream (no fork). Returns logged(name, fn): fn wrapped to log "NAME on STREAM" at each call, for the stages the
    test patches in."""

    class Stream:
        def __init__(self, name):
            self.name = name

        def wait_stream(self, other):
            log.append(f"{self.name} waits {other.name}")

        def record_event(self):
            log.append(f"{self.name} records")
            return self.name

        def wait_event(self, event):
            log.append(f"{self.name} waits {event}'s event")

    main, side, second = Stream("main"), Stream("side"), Stream("second")
    current = [main]

    @contextlib.contextmanager
    def on(stream):
        current.append(stream)
        yield
        current.pop()

    def logged(name, fn):
        return lambda *a, **kw: log.append(f"{name} on {current[-1].name}") or fn(*a, **kw)

    monkeypatch.setattr(pipeline, "side_stream", lambda device: main if caller_on_side else side)
    monkeypatch.setattr(pipeline, "chase_streams", lambda device: None if caller_on_side else (main, side, second))
    monkeypatch.setattr(pipeline.torch.cuda, "current_stream", lambda device=None: current[-1])
    monkeypatch.setattr(pipeline.torch.cuda, "stream", on)
    return logged
