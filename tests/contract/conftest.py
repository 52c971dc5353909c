import pytest

from .harness import HARNESSES


@pytest.fixture(params=sorted(HARNESSES))
async def harness(request, tmp_path):
    make = HARNESSES[request.param]
    if request.param == "sqlite":
        h = make(str(tmp_path))
    elif request.param in ("storage_queue", "servicebus"):
        h = make(request.getfixturevalue("azurite"))
    else:
        h = make()
    yield h
    if h.cleanup is not None:
        await h.cleanup()
