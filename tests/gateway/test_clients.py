"""gateway.clients: what the gateway remembers of each sequence a service may hold."""

from __future__ import annotations

import grpc
import pytest

from gateway.clients import RemoteTarget
from specdec.engine import Proposal
from specdec.sampling import SamplingParams


class _DeadlineExceeded(grpc.RpcError):
    def code(self):
        return grpc.StatusCode.DEADLINE_EXCEEDED

    def details(self):
        return "Deadline Exceeded"


class _Stub:
    """Verify fails as a deadline does after the service already created the sequence."""

    def __init__(self):
        self.released: list[str] = []

    def Verify(self, request, timeout=None):  # noqa: N802 - gRPC method name
        raise _DeadlineExceeded()

    def ReleaseSequence(self, request, timeout=None):  # noqa: N802 - gRPC method name
        self.released.append(request.sequence_id)


def test_a_sequence_whose_first_call_failed_is_still_released():
    client = RemoteTarget("127.0.0.1:1")  # never connected: the stub stands in for the service
    stub = client._stub = _Stub()
    try:
        with pytest.raises(TimeoutError):
            client.verify("s1", [1, 2, 3], Proposal([4]), SamplingParams(temperature=0))
        client.release("s1")
        assert stub.released == ["s1"]
        client.release("s1")  # once only
        assert stub.released == ["s1"]
        client.release("never-called")  # nothing was ever sent for it: nothing to release
        assert stub.released == ["s1"]
    finally:
        client.close()
