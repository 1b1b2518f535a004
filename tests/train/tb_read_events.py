#!/usr/bin/env python3
"""Reads a TensorBoard event file without TensorFlow or protobuf and prints it as JSON.

An independent reader for tests/train/report_test.cpp: checks each TFRecord's masked CRC32C of
the length and of the data (CRC computed bit by bit here), decodes the tensorflow.Event fields
(wall_time = 1 double, step = 2 varint, file_version = 3 string, summary = 5 message with
repeated value = 1 {tag = 1 string, simple_value = 2 float}) and fails on anything else.
Prints {"file_version": str, "events": [{"step", "wall_time", "scalars": {tag: value}}]}.
"""
import json
import struct
import sys


def crc32c(data):
    crc = 0xFFFFFFFF
    for byte in data:
        crc ^= byte
        for _ in range(8):
            crc = (crc >> 1) ^ (0x82F63B78 if crc & 1 else 0)
    return crc ^ 0xFFFFFFFF


def masked(data):
    c = crc32c(data)
    return (((c >> 15) | (c << 17)) + 0xA282EAD8) & 0xFFFFFFFF


def fields(buf):
    """Yields (field number, wire type, value) of a protobuf message."""
    i = 0
    while i < len(buf):
        key, i = varint(buf, i)
        num, wire = key >> 3, key & 7
        if wire == 0:
            v, i = varint(buf, i)
        elif wire == 1:
            v, i = buf[i:i + 8], i + 8
        elif wire == 2:
            n, i = varint(buf, i)
            v, i = buf[i:i + n], i + n
        elif wire == 5:
            v, i = buf[i:i + 4], i + 4
        else:
            raise ValueError(f"unexpected wire type {wire}")
        yield num, wire, v


def varint(buf, i):
    shift = result = 0
    while True:
        b = buf[i]
        i += 1
        result |= (b & 0x7F) << shift
        shift += 7
        if not b & 0x80:
            return result, i


def main(path):
    data = open(path, "rb").read()
    i, out = 0, {"file_version": None, "events": []}
    while i < len(data):
        header = data[i:i + 8]
        (n,) = struct.unpack("<Q", header)
        (hcrc,) = struct.unpack("<I", data[i + 8:i + 12])
        assert hcrc == masked(header), f"record at {i}: bad length CRC"
        payload = data[i + 12:i + 12 + n]
        (dcrc,) = struct.unpack("<I", data[i + 12 + n:i + 16 + n])
        assert dcrc == masked(payload), f"record at {i}: bad data CRC"
        i += 16 + n
        ev = {"step": 0, "wall_time": None, "scalars": {}}
        for num, wire, v in fields(payload):
            if (num, wire) == (1, 1):
                (ev["wall_time"],) = struct.unpack("<d", v)
            elif (num, wire) == (2, 0):
                ev["step"] = v
            elif (num, wire) == (3, 2):
                out["file_version"] = v.decode()
            elif (num, wire) == (5, 2):
                for snum, swire, sv in fields(v):
                    assert (snum, swire) == (1, 2), "Summary: expected only values"
                    tag = value = None
                    for vnum, vwire, vv in fields(sv):
                        if (vnum, vwire) == (1, 2):
                            tag = vv.decode()
                        elif (vnum, vwire) == (2, 5):
                            (value,) = struct.unpack("<f", vv)
                        else:
                            raise ValueError(f"Summary.Value: unexpected field {vnum}")
                    ev["scalars"][tag] = value
            else:
                raise ValueError(f"Event: unexpected field {num} (wire {wire})")
        if ev["scalars"]:
            out["events"].append(ev)
    json.dump(out, sys.stdout)


if __name__ == "__main__":
    main(sys.argv[1])
