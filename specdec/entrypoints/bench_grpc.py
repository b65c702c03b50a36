"""``specdec bench --endpoint grpc``: the same load through the gateway's gRPC ``GenerationService.Generate``
(server stream). Kept apart so that ``specdec bench`` over HTTP imports no grpc."""

from __future__ import annotations

import time

import grpc

from specdec.entrypoints.bench_result import SPEC_COUNTERS, RequestResult
from specdec.v1 import common_pb2, generation_service_pb2 as pb, generation_service_pb2_grpc


class GrpcClient:
    def __init__(self, addr: str, api_key: str | None, timeout: float):
        self.channel = grpc.insecure_channel(addr)
        self.stub = generation_service_pb2_grpc.GenerationServiceStub(self.channel)
        self.metadata = [("authorization", f"Bearer {api_key}")] if api_key else []
        self.timeout = timeout

    def model(self) -> str:
        return self.stub.GetInfo(common_pb2.GetInfoRequest(), metadata=self.metadata, timeout=self.timeout
                                 ).target.model_name

    def stream(self, prompt: str, max_tokens: int, temperature: float, ignore_eos: bool) -> RequestResult:
        result = RequestResult()
        request = pb.GenerateRequest(prompt=prompt, max_tokens=max_tokens, ignore_eos=ignore_eos,
                                     sampling_params=common_pb2.SamplingParams(temperature=temperature))
        start = last = time.perf_counter()
        chunks = 0
        response = None
        try:
            for response in self.stub.Generate(request, metadata=self.metadata, timeout=self.timeout):
                if not response.token_ids:
                    continue
                now = time.perf_counter()
                if chunks == 0:
                    result.ttft = now - start
                else:
                    result.itl.append(now - last)
                last, chunks = now, chunks + 1
        except grpc.RpcError as exc:
            result.error = f"{exc.code().name}: {exc.details()}"[:200]
            return result
        result.e2e = time.perf_counter() - start
        if response is not None:
            result.prompt_tokens, result.output_tokens = response.prompt_tokens, response.completion_tokens
            result.spec_decode = {n: getattr(response.stats, n) for n in SPEC_COUNTERS}
        result.ok = True
        return result

    def close(self) -> None:
        self.channel.close()
