"""The committed gRPC code matches protos/ (regenerate with `python -m specdec.entrypoints.protogen`)."""

from specdec.entrypoints import protogen
from specdec.v1 import common_pb2, draft_service_pb2, generation_service_pb2, target_service_pb2


def test_generated_code_is_not_stale():
    assert protogen.stale_files() == [], "run `python -m specdec.entrypoints.protogen` and commit the result"


def test_proto_conventions():
    files = [common_pb2, draft_service_pb2, target_service_pb2, generation_service_pb2]
    for mod in files:
        fd = mod.DESCRIPTOR
        assert fd.package == "specdec.v1"
        assert len(fd.services_by_name) <= 1, f"{fd.name}: one service per file"
        for enum in fd.enum_types_by_name.values():
            first = enum.values_by_number[0].name
            assert first.endswith("_UNSPECIFIED"), f"{enum.name}: value 0 must be *_UNSPECIFIED, got {first}"
        for service in fd.services_by_name.values():
            for method in service.methods:
                assert method.input_type.name.endswith("Request")
                assert method.output_type.name.endswith("Response")
    # token ids travel as repeated uint32
    verify = target_service_pb2.VerifyRequest.DESCRIPTOR
    for name in ("new_token_ids", "draft_token_ids"):
        field = verify.fields_by_name[name]
        assert field.type == field.TYPE_UINT32 and field.is_repeated
