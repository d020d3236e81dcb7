"""Capturing links: what crosses them, into pcap files, and what they did to each flow.

`ring` is the packet socket (AF_PACKET, a TPACKET_V3 ring, a kernel filter for one link's
frames), `pcap` the bounded writer and the reader into arrays, `tap` the capture points and
their threads (`LinkCapture`: both ends of links of a lab), `flows` the per-flow analysis of a
link's two files (lost, retransmitted, reordered, duplicated, delay). docs/capture.md.
"""

from netem.capture.flows import FLOWS, MANIFEST, analyse, analyse_link, load_manifest, write_flows
from netem.capture.pcap import BoundedPcap, Frames, PcapError, read_frames
from netem.capture.ring import Ring, link_filter
from netem.capture.tap import Endpoint, LinkCapture, Tap, TapStats

__all__ = [
    "FLOWS",
    "MANIFEST",
    "BoundedPcap",
    "Endpoint",
    "Frames",
    "LinkCapture",
    "PcapError",
    "Ring",
    "Tap",
    "TapStats",
    "analyse",
    "analyse_link",
    "link_filter",
    "load_manifest",
    "read_frames",
    "write_flows",
]
