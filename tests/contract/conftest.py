import pytest

from .harness import HARNESSES


@pytest.fixture(params=sorted(HARNESSES))
async def harness(request):
    h = HARNESSES[request.param]()
    yield h
    if h.cleanup is not None:
        await h.cleanup()
