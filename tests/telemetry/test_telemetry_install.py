"""The install holds opentelemetry-proto's own files, not the older copy xds-protos ships.

Both distributions write ``opentelemetry/proto/...``; the one installed last wins. With the
older copy the OTLP exporter cannot even be imported, so the gateway could not start.
"""

from opentelemetry.proto.common.v1 import common_pb2


def test_the_otlp_exporter_and_the_endpoint_picker_import_side_by_side() -> None:
    from envoy.service.ext_proc.v3 import external_processor_pb2
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

    assert "InstrumentationScope" in common_pb2.DESCRIPTOR.message_types_by_name
    assert external_processor_pb2.DESCRIPTOR.services_by_name["ExternalProcessor"]
    assert OTLPSpanExporter.__name__ == "OTLPSpanExporter"
