"""The messages of services.proto, built with protobuf's runtime (no generated code): a private
descriptor pool, so a process that also imports LeRobot's own stubs (same package, same names) has
no clash."""

from __future__ import annotations

from google.protobuf import descriptor_pb2, descriptor_pool, message_factory

PACKAGE = "transport"
SERVICE = f"{PACKAGE}.AsyncInference"
TRANSFER_STATES = ("TRANSFER_UNKNOWN", "TRANSFER_BEGIN", "TRANSFER_MIDDLE", "TRANSFER_END")
TRANSFER_UNKNOWN, TRANSFER_BEGIN, TRANSFER_MIDDLE, TRANSFER_END = range(4)
_F = descriptor_pb2.FieldDescriptorProto
# message -> its fields: (name, number, type, enum type name)
MESSAGES = {
    "Observation": (("transfer_state", 1, _F.TYPE_ENUM, f".{PACKAGE}.TransferState"), ("data", 2, _F.TYPE_BYTES, "")),
    "Actions": (("data", 1, _F.TYPE_BYTES, ""),),
    "PolicySetup": (("data", 1, _F.TYPE_BYTES, ""),),
    "Empty": (),
}
# method -> (input, output, client streaming)
METHODS = {
    "SendObservations": ("Observation", "Empty", True),
    "GetActions": ("Empty", "Actions", False),
    "SendPolicyInstructions": ("PolicySetup", "Empty", False),
    "Ready": ("Empty", "Empty", False),
}


def file_descriptor() -> descriptor_pb2.FileDescriptorProto:
    """services.proto as a FileDescriptorProto."""
    file = descriptor_pb2.FileDescriptorProto(name="vlaserve/server/lerobot/services.proto", package=PACKAGE,
                                              syntax="proto3")
    enum = file.enum_type.add(name="TransferState")
    for number, name in enumerate(TRANSFER_STATES):
        enum.value.add(name=name, number=number)
    for name, fields in MESSAGES.items():
        message = file.message_type.add(name=name)
        for field, number, kind, type_name in fields:
            message.field.add(name=field, number=number, type=kind, label=_F.LABEL_OPTIONAL,
                              **({"type_name": type_name} if type_name else {}))
    service = file.service.add(name="AsyncInference")
    for name, (inp, out, streaming) in METHODS.items():
        service.method.add(name=name, input_type=f".{PACKAGE}.{inp}", output_type=f".{PACKAGE}.{out}",
                           **({"client_streaming": True} if streaming else {}))
    return file


_pool = descriptor_pool.DescriptorPool()
_pool.Add(file_descriptor())
Observation, Actions, PolicySetup, Empty = (
    message_factory.GetMessageClass(_pool.FindMessageTypeByName(f"{PACKAGE}.{name}")) for name in MESSAGES)
