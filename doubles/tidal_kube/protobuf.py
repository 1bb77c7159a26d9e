"""Protobuf bodies: client-go's typed clients send built-in kinds in Kubernetes' protobuf encoding
(helm stores its releases as Secrets so; ``kubectl create secret|configmap|namespace|
serviceaccount`` too). Those kinds are decoded; others are refused with 415."""

from __future__ import annotations

import base64
import collections
from collections.abc import Callable
from typing import Any

from tidal_kube.resources import Obj, Resource, api_error

PROTOBUF = "application/vnd.kubernetes.protobuf"

# Per kind: the fields of its protobuf message after metadata (1), as (number, name, decoder);
# a field not listed here, if not empty, is refused rather than dropped.
_b64 = lambda raw: base64.b64encode(raw).decode()  # noqa: E731
_PROTOBUF_FIELDS: dict[str, tuple[tuple[int, str, Callable[[Any], Any]], ...]] = {
    "secrets": ((2, "data", lambda v: _proto_map(v, _b64)),
                (3, "type", lambda v: v[0].decode()),
                (4, "stringData", lambda v: _proto_map(v, bytes.decode)),
                (5, "immutable", lambda v: bool(v[0]))),
    "configmaps": ((2, "data", lambda v: _proto_map(v, bytes.decode)),
                   (3, "binaryData", lambda v: _proto_map(v, _b64)),
                   (4, "immutable", lambda v: bool(v[0]))),
    "namespaces": ((2, "spec", lambda v: {"finalizers": [
                        f.decode() for f in _proto_message(v[0])[1]]}),
                   (3, "status", lambda v: {})),  # the server's to set
    "serviceaccounts": ((3, "imagePullSecrets", lambda v: [
                             {"name": _proto_message(ref)[1][0].decode()} for ref in v]),
                        (4, "automountServiceAccountToken", lambda v: bool(v[0]))),
}


def _proto_message(data: bytes) -> dict[int, list[Any]]:
    """A protobuf message's fields by number: varints as ints, length-delimited as bytes."""
    fields: dict[int, list[Any]] = collections.defaultdict(list)
    pos = 0

    def varint() -> int:
        nonlocal pos
        result = shift = 0
        while True:
            byte = data[pos]
            pos += 1
            result |= (byte & 0x7F) << shift
            shift += 7
            if byte < 0x80:
                return result

    while pos < len(data):
        key = varint()
        number, wire = key >> 3, key & 7
        if wire == 0:
            fields[number].append(varint())
        elif wire in (1, 2, 5):
            size = {1: 8, 5: 4}.get(wire) or varint()
            fields[number].append(data[pos:pos + size])
            pos += size
        else:
            raise ValueError(f"protobuf wire type {wire} is not supported")
    return fields


def _proto_map(entries: list[bytes], value: Callable[[bytes], Any]) -> dict[str, Any]:
    """A protobuf map<string, ...>: entries with the key in field 1 and the value in 2."""
    out = {}
    for entry in entries:
        fields = _proto_message(entry)
        out[(fields[1] or [b""])[0].decode()] = value((fields[2] or [b""])[0])
    return out


def _proto_metadata(data: bytes) -> Obj:
    """ObjectMeta: what a client sets (the server owns the rest)."""
    fields = _proto_message(data)
    meta: Obj = {name: fields[number][0].decode() for number, name in (
        (1, "name"), (2, "generateName"), (3, "namespace"), (5, "uid"), (6, "resourceVersion"))
        if fields[number] and fields[number][0]}  # protobuf writes empty strings too
    for number, name in ((11, "labels"), (12, "annotations")):
        if fields[number]:
            meta[name] = _proto_map(fields[number], bytes.decode)
    if fields[14]:
        meta["finalizers"] = [f.decode() for f in fields[14]]
    owners = []
    for ref in map(_proto_message, fields[13]):
        owner = {name: ref[number][0].decode() for number, name in (
            (1, "kind"), (3, "name"), (4, "uid"), (5, "apiVersion")) if ref[number]}
        owner |= {name: bool(ref[number][0]) for number, name in (
            (6, "controller"), (7, "blockOwnerDeletion")) if ref[number]}
        owners.append(owner)
    if owners:
        meta["ownerReferences"] = owners
    return meta


def from_protobuf(resource: Resource, body: bytes) -> Obj:
    """An object of the kinds above from its protobuf encoding: the magic ``k8s`` and a zero
    byte, then a runtime.Unknown whose field 2 is the object's message."""
    known = _PROTOBUF_FIELDS.get(resource.plural) if not resource.group else None
    if known is None:
        raise api_error(415, "UnsupportedMediaType", f"the emulator reads {resource.qualified} "
                        "as JSON only, not protobuf")
    try:
        if not body.startswith(b"k8s\x00"):
            raise ValueError("no k8s protobuf envelope")
        obj = _proto_message((_proto_message(body[4:])[2] or [b""])[0])
        out: Obj = {"apiVersion": "v1", "kind": resource.kind,
                    "metadata": _proto_metadata((obj.pop(1, None) or [b""])[0])}
        for number, name, decode in known:
            if values := obj.pop(number, None):
                out[name] = decode(values)
    except (ValueError, IndexError) as exc:
        raise api_error(400, "BadRequest", f"the protobuf body could not be decoded: {exc}") \
            from None
    if any(value not in (b"", 0) for values in obj.values() for value in values):
        raise api_error(415, "UnsupportedMediaType", f"the emulator decodes only some fields of "
                        f"{resource.qualified} from protobuf: send JSON")
    return out
