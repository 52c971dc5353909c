import pytest

from .harness import HARNESSES


@pytest.fixture(params=sorted(HARNESSES))
async def harness(request, tmp_path):
    make = HARNESSES[request.param]
    h = make(str(tmp_path)) if request.param == "sqlite" else make()
    yield h
    if h.cleanup is not None:
        await h.cleanup()
