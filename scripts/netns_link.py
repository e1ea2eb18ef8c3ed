#!/usr/bin/env python3
"""Veth pairs, addresses and link state through the kernel's netlink, without ``ip``.

Used by scripts/gpu_cluster_rehearsal.sh on machines that have no iproute2 (the lent GPU
machines): only the Python standard library, run as root.

    netns_link.py veth NAME PID_A PID_B   a veth pair whose ends are both called NAME, one in
                                          the network namespace of process PID_A, one in PID_B's
    netns_link.py addr NAME ADDR/PREFIX   in this process's namespace: add the IPv4 address to
                                          NAME, bring NAME and lo up
    netns_link.py up NAME | down NAME     bring NAME up or down in this namespace

Errors print the kernel's reason (e.g. "File exists") and exit 1.
"""
import errno
import os
import socket
import struct
import sys

RTM_NEWLINK, RTM_NEWADDR = 16, 20
NLM_F_REQUEST, NLM_F_ACK, NLM_F_EXCL, NLM_F_CREATE = 0x1, 0x4, 0x200, 0x400
NLMSG_ERROR = 2
IFLA_IFNAME, IFLA_LINKINFO, IFLA_NET_NS_PID = 3, 18, 19
IFLA_INFO_KIND, IFLA_INFO_DATA, VETH_INFO_PEER = 1, 2, 1
IFA_ADDRESS, IFA_LOCAL = 1, 2
IFF_UP = 0x1


def _attr(kind, payload):
    """One rtattr (length, type, payload), padded to 4 bytes."""
    head = struct.pack("=HH", 4 + len(payload), kind)
    pad = b"\0" * (-len(payload) % 4)
    return head + payload + pad


def _ifinfo(index=0, flags=0, change=0):
    return struct.pack("=BxHiII", socket.AF_UNSPEC, 0, index, flags, change)


def _request(kind, flags, body):
    """Send one netlink request and wait for its acknowledgement; raise OSError on a refusal."""
    with socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, socket.NETLINK_ROUTE) as s:
        s.bind((0, 0))
        seq = 1
        msg = struct.pack("=LHHLL", 16 + len(body), kind, NLM_F_REQUEST | NLM_F_ACK | flags,
                          seq, 0) + body
        s.sendto(msg, (0, 0))
        while True:
            data = s.recv(65536)
            offset = 0
            while offset + 16 <= len(data):
                length, mtype, _, mseq, _ = struct.unpack_from("=LHHLL", data, offset)
                if mtype == NLMSG_ERROR and mseq == seq:
                    code = struct.unpack_from("=i", data, offset + 16)[0]
                    if code:
                        raise OSError(-code, os.strerror(-code))
                    return
                offset += (length + 3) & ~3


def veth(name, pid_a, pid_b):
    """A veth pair: end NAME in pid_a's network namespace, its peer NAME in pid_b's."""
    peer = _ifinfo() + _attr(IFLA_IFNAME, name.encode() + b"\0") + \
        _attr(IFLA_NET_NS_PID, struct.pack("=I", pid_b))
    info = _attr(IFLA_INFO_KIND, b"veth\0") + _attr(IFLA_INFO_DATA, _attr(VETH_INFO_PEER, peer))
    body = _ifinfo() + _attr(IFLA_IFNAME, name.encode() + b"\0") + \
        _attr(IFLA_NET_NS_PID, struct.pack("=I", pid_a)) + _attr(IFLA_LINKINFO, info)
    _request(RTM_NEWLINK, NLM_F_CREATE | NLM_F_EXCL, body)


def set_up(name, up=True):
    index = socket.if_nametoindex(name)
    _request(RTM_NEWLINK, 0, _ifinfo(index, IFF_UP if up else 0, IFF_UP))


def addr(name, cidr):
    """Add an IPv4 address (a.b.c.d/prefix) to NAME, then bring NAME and lo up."""
    address, _, prefix = cidr.partition("/")
    packed = socket.inet_aton(address)
    index = socket.if_nametoindex(name)
    body = struct.pack("=BBBBI", socket.AF_INET, int(prefix or 32), 0, 0, index) + \
        _attr(IFA_LOCAL, packed) + _attr(IFA_ADDRESS, packed)
    _request(RTM_NEWADDR, NLM_F_CREATE | NLM_F_EXCL, body)
    set_up("lo")
    set_up(name)


def main(argv):
    usage = "usage: netns_link.py veth NAME PID_A PID_B | addr NAME ADDR/PREFIX | up NAME | down NAME"
    try:
        if len(argv) == 4 and argv[0] == "veth":
            veth(argv[1], int(argv[2]), int(argv[3]))
        elif len(argv) == 3 and argv[0] == "addr":
            addr(argv[1], argv[2])
        elif len(argv) == 2 and argv[0] in ("up", "down"):
            set_up(argv[1], argv[0] == "up")
        else:
            print(usage, file=sys.stderr)
            return 2
    except (OSError, ValueError) as exc:
        reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
        if isinstance(exc, OSError) and exc.errno == errno.EPERM:
            reason += " (needs root)"
        print(f"netns_link.py {' '.join(argv)}: {reason}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
