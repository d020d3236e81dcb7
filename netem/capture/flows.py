"""What a link did to each flow, from the frames seen at both of its ends.

A link's capture has two files: what the sender put on the wire (`sent`) and what reached the
receiver (`received`). Both are read into arrays (`pcap.read_frames`) and dissected with numpy
(Ethernet, IPv4, TCP, UDP headers at once, not frame by frame), then:

- **Flows**: IPv4 5-tuples (protocol, source address and port, destination address and port)
  for TCP and UDP; everything else on the link (ICMP, IP fragments after the first) is one flow
  per link with protocol "other". A flow is one direction: a TCP connection's ACKs are on the
  reverse link.
- **Matching**: a frame crosses a bridge unchanged, so the same frame has the same bytes at both
  ends. Its key is the length on the wire and every captured byte from the IP header on, less
  the TTL and the header checksum (the two fields a router would change): the IP id, ports,
  TCP sequence and acknowledgement numbers, options (timestamps) and the first payload bytes
  all count. Frames with one key are matched in order (the k-th sent to the k-th received).
- **lost**: sent, never received. **duplicated**: received more often than sent.
  **unmatched**: received, never sent (changed on the way, e.g. netem's corruption, or sent
  outside the capture). **reordered**: received after a frame of its flow that was sent later
  (RFC 4737's reordered packets). **retransmitted**: on the sender's side, a TCP segment whose
  sequence range (SYN and FIN count one) starts below the highest one the flow had sent before.
  **delay**: receive time less send time of each matched frame (both files take their times
  from one clock: one host's kernel).

When a file was cut at its size limit, the counts cover what both files hold: with the received
file cut, sent frames after the last one that was received are not counted as lost; with the
sent file cut, received frames after the cut are not counted as unmatched.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from netem.capture.pcap import Frames, read_frames

MANIFEST = "capture.json"
FLOWS = "flows.json"
TCP, UDP, OTHER = 6, 17, 0
PROTOCOLS = {TCP: "tcp", UDP: "udp", OTHER: "other"}
SYN, FIN = 0x02, 0x01
COUNTS = ("sent_packets", "sent_bytes", "received_packets", "received_bytes", "lost",
          "retransmitted", "retransmitted_bytes", "reordered", "duplicated", "unmatched")


@dataclass
class Headers:
    """The fields of every frame, dissected at once: `flow` columns (protocol, source, source
    port, destination, destination port), TCP sequence number, segment length (payload plus SYN
    and FIN), and whether each frame is TCP."""

    protocol: np.ndarray
    src: np.ndarray
    sport: np.ndarray
    dst: np.ndarray
    dport: np.ndarray
    seq: np.ndarray
    segment: np.ndarray
    payload: np.ndarray



def _u16(data: np.ndarray, rows: np.ndarray, at: np.ndarray) -> np.ndarray:
    return data[rows, at].astype(np.int64) << 8 | data[rows, at + 1]


def _u32(data: np.ndarray, rows: np.ndarray, at: np.ndarray) -> np.ndarray:
    return _u16(data, rows, at) << 16 | _u16(data, rows, at + 2)


def dissect(frames: Frames) -> Headers:
    """Ethernet, IPv4, then TCP or UDP, of every frame at once."""
    data = frames.data
    n, width = data.shape
    rows = np.arange(n)
    column = np.full(n, 0, np.int64)

    def at(offset: int | np.ndarray) -> np.ndarray:
        return np.minimum(column + offset, width - 2)

    ipv4 = ((_u16(data, rows, at(12)) == 0x0800) & (data[rows, at(14)] >> 4 == 4)
            & (frames.caplen >= 34))
    ihl = (data[rows, at(14)] & 0x0F).astype(np.int64) * 4
    total = _u16(data, rows, at(16))
    fragment = _u16(data, rows, at(20)) & 0x1FFF
    proto = data[rows, at(23)].astype(np.int64)
    l4 = 14 + ihl
    tcp = ipv4 & (proto == TCP) & (fragment == 0) & (frames.caplen >= l4 + 14)
    udp = ipv4 & (proto == UDP) & (fragment == 0) & (frames.caplen >= l4 + 8)
    ported = tcp | udp
    protocol = np.where(tcp, TCP, np.where(udp, UDP, OTHER))
    src = np.where(ipv4, _u32(data, rows, at(26)), 0)
    dst = np.where(ipv4, _u32(data, rows, at(30)), 0)
    sport = np.where(ported, _u16(data, rows, at(l4)), 0)
    dport = np.where(ported, _u16(data, rows, at(l4 + 2)), 0)
    seq = np.where(tcp, _u32(data, rows, at(l4 + 4)), 0)
    offset = (data[rows, at(l4 + 12)] >> 4).astype(np.int64) * 4
    flags = data[rows, at(l4 + 13)].astype(np.int64)
    payload = np.where(tcp, total - ihl - offset, np.where(udp, total - ihl - 8, 0))
    payload = np.maximum(payload, 0)
    segment = np.where(tcp, payload + (flags & SYN > 0) + (flags & FIN > 0), 0)
    return Headers(protocol=protocol, src=src, sport=sport, dst=dst, dport=dport, seq=seq,
                   segment=segment, payload=payload)


def frame_keys(frames: Frames, width: int) -> np.ndarray:
    """Each frame's identity on the path, as a row of bytes: its length on the wire, then
    `width` bytes from the IP header on (zero-padded), the TTL and header checksum zeroed."""
    body = np.zeros((len(frames), width), np.uint8)
    take = min(width, max(frames.width - 14, 0))
    body[:, :take] = frames.data[:, 14:14 + take]
    kept = np.arange(width)[None, :] < (frames.caplen - 14)[:, None]
    body[~kept] = 0
    if width > 11:
        body[:, 8] = 0  # TTL
        body[:, 10:12] = 0  # header checksum
    length = frames.length.astype(">u4").view(np.uint8).reshape(-1, 4)
    return np.ascontiguousarray(np.concatenate([length, body], axis=1))


def _hash_rows(rows: np.ndarray) -> np.ndarray:
    """A 64-bit hash of each row of a byte matrix (FNV-style over 8-byte words, then mixed)."""
    n, width = rows.shape
    padded = np.zeros((n, -(-width // 8) * 8), np.uint8)
    padded[:, :width] = rows
    words = padded.view("<u8")
    value = np.full(n, 0xCBF29CE484222325, np.uint64)
    prime = np.uint64(0x100000001B3)
    with np.errstate(over="ignore"):
        for column in words.T:
            value = (value ^ column) * prime
            value ^= value >> np.uint64(29)
    return value


def _ids(*matrices: np.ndarray) -> list[np.ndarray]:
    """Rows of several byte matrices (same width) numbered alike: equal rows, equal ids (by a
    64-bit hash: two different rows of a link's frames share one with odds near 2^-64 per
    pair, and matched frames are compared byte for byte afterwards)."""
    hashes = np.concatenate([_hash_rows(m) for m in matrices])
    _, inverse = np.unique(hashes, return_inverse=True)
    inverse = inverse.ravel().astype(np.int64)
    cuts = np.cumsum([len(m) for m in matrices])[:-1]
    return np.split(inverse, cuts)


def _flow_ids(*headers: Headers) -> tuple[np.ndarray, list[np.ndarray]]:
    """The flows (rows of protocol, source, source port, destination, destination port) of
    several frame sets, and each frame's flow id."""
    def column(name: str) -> np.ndarray:
        return np.concatenate([getattr(h, name) for h in headers]).astype(np.int64)

    protocol, src, sport, dst, dport = map(column, ("protocol", "src", "sport", "dst", "dport"))
    _, hosts = np.unique(src << 32 | dst, return_inverse=True)  # (an address pair, usually one)
    code = hosts.ravel().astype(np.int64) << 40 | protocol << 32 | sport << 16 | dport
    _, ids = np.unique(code, return_inverse=True)
    ids = ids.ravel().astype(np.int64)
    table = np.zeros((int(ids.max()) + 1 if len(ids) else 0, 5), np.int64)
    for k, values in enumerate((protocol, src, sport, dst, dport)):
        table[ids, k] = values
    cuts = np.cumsum([len(h.protocol) for h in headers])[:-1]
    return table, np.split(ids, cuts)


def _occurrence(keys: np.ndarray) -> np.ndarray:
    """For each position, how many earlier positions hold the same key (0 for the first)."""
    n = len(keys)
    order = np.argsort(keys, kind="stable")
    ordered = keys[order]
    starts = np.r_[True, ordered[1:] != ordered[:-1]] if n else np.zeros(0, bool)
    first = np.maximum.accumulate(np.where(starts, np.arange(n), 0)) if n else starts
    occurrence = np.empty(n, np.int64)
    occurrence[order] = np.arange(n) - first
    return occurrence


def _later_than_earlier(values: np.ndarray, groups: np.ndarray) -> np.ndarray:
    """Whether each value is below the largest value before it in its group (values in
    sequence order; groups need not be contiguous)."""
    n = len(values)
    if not n:
        return np.zeros(0, bool)
    order = np.lexsort((np.arange(n), groups))
    shifted = values[order] - values.min()
    span = int(shifted.max()) + 1
    lifted = shifted + groups[order] * span
    best = np.maximum.accumulate(lifted)
    before = np.r_[-1, best[:-1]]
    result = np.empty(n, bool)
    result[order] = lifted < before
    return result


def _retransmitted(headers: Headers, flows: np.ndarray) -> np.ndarray:
    """TCP segments (on the sender's side, in sending order) whose sequence range starts below
    the highest end the flow had sent: sequence numbers unwrapped per flow (32-bit)."""
    n = len(flows)
    result = np.zeros(n, bool)
    tcp = np.flatnonzero(headers.protocol == TCP)
    if not len(tcp):
        return result
    order = tcp[np.lexsort((tcp, flows[tcp]))]
    group = flows[order]
    seq = headers.seq[order]
    step = ((seq[1:] - seq[:-1] + 2**31) % 2**32) - 2**31  # signed 32-bit difference
    new_group = np.r_[True, group[1:] != group[:-1]]
    step = np.r_[0, step]
    step[new_group] = 0
    position = np.cumsum(step)
    group_start = np.maximum.accumulate(np.where(new_group, np.arange(len(order)), 0))
    start = position - position[group_start]
    length = headers.segment[order]
    end = start + length
    low = min(int(start.min()), 0)
    span = int(end.max()) - low + 1
    lifted_end = end - low + group * span
    best = np.maximum.accumulate(lifted_end)
    before = np.r_[-1, best[:-1]]
    before[new_group] = -1
    retransmitted = (length > 0) & (start - low + group * span < before)
    result[order] = retransmitted
    return result


def analyse_link(sent: Frames, received: Frames, *, sent_cut: float | None = None,
                 received_cut: float | None = None,
                 origin: float | None = None) -> dict[str, Any]:
    """Per flow and in total, what the link did between `sent` and `received` (see the module's
    docstring). `sent_cut`/`received_cut`: when the file was cut at its size limit (seconds
    since the epoch), to count only what both hold; `origin`: seconds since the epoch that
    `first_t`/`last_t` count from (the run's start)."""
    width = max(min(sent.snap, received.snap, sent.width, received.width) - 14, 20)
    sent_rows, received_rows = frame_keys(sent, width), frame_keys(received, width)
    sent_keys, received_keys = _ids(sent_rows, received_rows)
    sent_headers, received_headers = dissect(sent), dissect(received)
    flow_table, (sent_flow, received_flow) = _flow_ids(sent_headers, received_headers)
    flow_ids = np.concatenate([sent_flow, received_flow])
    flows = len(flow_table)

    # Match the k-th frame of a key sent to the k-th received.
    keys = int(max(sent_keys.max(initial=-1), received_keys.max(initial=-1))) + 1
    scale = max(len(sent), len(received)) + 1
    sent_code = sent_keys * scale + _occurrence(sent_keys)
    received_occurrence = _occurrence(received_keys)
    received_code = received_keys * scale + received_occurrence
    order = np.argsort(sent_code)
    place = np.searchsorted(sent_code[order], received_code)
    place = np.minimum(place, max(len(sent) - 1, 0))
    matched = (sent_code[order][place] == received_code) if len(sent) else np.zeros(
        len(received), bool)
    origin_index = np.where(matched, order[place] if len(sent) else 0, -1)
    collided = np.zeros(len(received), bool)  # a hash shared by different frames
    collided[matched] = ~(sent_rows[origin_index[matched]] == received_rows[matched]).all(axis=1)
    matched &= ~collided
    origin_index[~matched] = -1
    sent_count = np.bincount(sent_keys, minlength=keys)
    known = sent_count[received_keys] > 0 if len(received) else np.zeros(0, bool)
    duplicated = known & ~matched & ~collided
    unmatched = ~known | collided
    if sent_cut is not None:  # the sent file ends early: later arrivals are not unknown
        unmatched &= received.time < sent_cut * 1e9

    arrived = np.zeros(len(sent), bool)
    arrived[origin_index[matched]] = True
    lost = ~arrived
    if received_cut is not None:  # the received file ends early: count up to its last match
        horizon = int(origin_index[matched].max()) if matched.any() else -1
        lost[horizon + 1:] = False

    reordered = np.zeros(len(received), bool)
    reordered[matched] = _later_than_earlier(origin_index[matched], received_flow[matched])
    retransmitted = _retransmitted(sent_headers, sent_flow)

    def per_flow(ids: np.ndarray, weights: np.ndarray | None = None) -> np.ndarray:
        return np.bincount(ids, weights=weights, minlength=flows).astype(np.int64)

    table = {
        "sent_packets": per_flow(sent_flow),
        "sent_bytes": per_flow(sent_flow, sent.length),
        "received_packets": per_flow(received_flow),
        "received_bytes": per_flow(received_flow, received.length),
        "lost": per_flow(sent_flow[lost]),
        "retransmitted": per_flow(sent_flow[retransmitted]),
        "retransmitted_bytes": per_flow(sent_flow[retransmitted],
                                        sent_headers.payload[retransmitted]),
        "reordered": per_flow(received_flow[reordered]),
        "duplicated": per_flow(received_flow[duplicated]),
        "unmatched": per_flow(received_flow[unmatched]),
    }
    times = np.concatenate([sent.time, received.time])
    first = np.full(flows, np.iinfo(np.int64).max)
    last = np.full(flows, np.iinfo(np.int64).min)
    np.minimum.at(first, flow_ids, times)
    np.maximum.at(last, flow_ids, times)
    delays = (received.time[matched] - sent.time[origin_index[matched]]) / 1e9
    delay_flow = received_flow[matched]
    by_flow = np.argsort(delay_flow, kind="stable")
    bounds = np.searchsorted(delay_flow[by_flow], np.arange(flows + 1))

    result = []
    for f in range(flows):
        protocol, src, sport, dst, dport = (int(v) for v in flow_table[f])
        row: dict[str, Any] = {
            "protocol": PROTOCOLS.get(protocol, "other"),
            "src": _address(src), "sport": sport, "dst": _address(dst), "dport": dport,
            **{name: int(values[f]) for name, values in table.items()},
            "first": first[f] / 1e9, "last": last[f] / 1e9,
        }
        if origin is not None:
            row["first_t"], row["last_t"] = row["first"] - origin, row["last"] - origin
        own = delays[by_flow[bounds[f]:bounds[f + 1]]]
        row["delay_seconds"] = _spread(own)
        result.append(row)
    result.sort(key=lambda r: (-r["sent_packets"] - r["received_packets"], r["protocol"],
                               r["sport"], r["dport"]))
    totals: dict[str, Any] = {name: int(values.sum()) for name, values in table.items()}
    totals["flows"] = flows
    totals["delay_seconds"] = _spread(delays)
    return {"flows": result, "totals": totals,
            "complete": sent_cut is None and received_cut is None}


def _spread(delays: np.ndarray) -> dict[str, float] | None:
    if not len(delays):
        return None
    median, p99 = np.percentile(delays, [50, 99])
    return {"median": float(median), "p99": float(p99), "max": float(delays.max())}


def _address(value: int) -> str:
    return ".".join(str(value >> shift & 0xFF) for shift in (24, 16, 8, 0))


def analyse(directory: str | Path, *, origin: float | None = None,
            links: list[str] | None = None) -> dict[str, Any]:
    """Every captured link of a capture directory (its `capture.json` and pcap files), or only
    `links` (their names, e.g. "0->1"): the flows document that `flows.json` holds."""
    import time

    started = time.perf_counter()
    directory = Path(directory)
    manifest = load_manifest(directory)
    if origin is None:
        origin = manifest.get("origin")
    out: list[dict[str, Any]] = []
    for link in manifest["links"]:
        if links is not None and link["link"] not in links:
            continue
        sent, received = link["sent"], link["received"]
        analysis = analyse_link(
            read_frames(directory / sent["file"]), read_frames(directory / received["file"]),
            sent_cut=sent.get("cut") if sent.get("truncated") else None,
            received_cut=received.get("cut") if received.get("truncated") else None,
            origin=origin)
        drops = {side: link[side].get("kernel_drops", 0) for side in ("sent", "received")}
        out.append({"link": link["link"], "src": link["src"], "dst": link["dst"],
                    "files": {side: link[side]["file"] for side in ("sent", "received")},
                    "truncated": {side: bool(link[side].get("truncated"))
                                  for side in ("sent", "received")},
                    "kernel_drops": drops, **analysis})
    return {"format": 1, "snap": manifest.get("snap"), "max_bytes": manifest.get("max_bytes"),
            "origin": origin, "links": out,
            "truncated": any(any(link["truncated"].values()) for link in out),
            "seconds": time.perf_counter() - started}


def load_manifest(directory: str | Path) -> dict[str, Any]:
    """A capture directory's `capture.json` (what was captured where, and each file's bounds);
    `FileNotFoundError` if there is none, `ValueError` if it is not one."""
    path = Path(directory) / MANIFEST
    data = json.loads(path.read_text())
    if not isinstance(data, dict) or not isinstance(data.get("links"), list):
        raise ValueError(f"{path}: not a capture manifest (no links)")
    return data


def write_flows(directory: str | Path, flows: dict[str, Any]) -> Path:
    path = Path(directory) / FLOWS
    temporary = path.with_suffix(".json.tmp")
    temporary.write_text(json.dumps(flows, indent=2) + "\n")
    temporary.replace(path)
    return path
