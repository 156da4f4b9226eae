"""The limits every untrusted pickle is read under, checked by a scan of its opcodes before anything is unpickled.

A pickle of a few hundred bytes can describe an object whose expansion is exponential: each level a tuple or list
of two memo references to the level below (``BINGET``). Unpickled, it is small (shared), but anything that walks
it - ``str()`` / ``repr()`` in a message, ``hash()`` of it as a dict key or set member (a tuple's hash is not
cached; CPython's tuplehash walks every item), ``==`` - takes 2**levels steps inside one C call, where neither
SIGINT nor SIGTERM is delivered (Python runs signal handlers between bytecodes). The C unpickler itself is linear
in the pickle's size; what it hashes while it loads (``SETITEM(S)``, ``ADDITEMS``, ``FROZENSET``, ``set()`` /
``frozenset()`` / ``OrderedDict`` of an iterable) is not.

:func:`scan` walks the opcodes (pure Python: bounded by the byte count, signals delivered between opcodes) and
tracks, for every object on the unpickler's stack and in its memo, its *weight* (the node count of its full
expansion, shared parts counted each time they are reached) and depth. It refuses, in one line naming the file:
a pickle over :data:`MAX_BYTES`; an object heavier than ``WEIGHT_PER_BYTE`` times the pickle's size (+
``WEIGHT_FLOOR``; so walking any one object is linear in the file) or deeper than :data:`MAX_DEPTH`; a dict key or
set member heavier than :data:`MAX_KEY_WEIGHT` (hashing stays bounded); a container changed after it was shared
(its weight would be stale); opcodes no pickle we read uses (``INST`` / ``OBJ`` / the ``EXT`` registry / buffers /
``DUP``). The opcode table is pickle's own (Lib/pickle.py, Lib/pickletools.py ``opcodes``). Measured on the 235B
structural twin's 26 MB ``.metadata`` (docs/performance.md): the scan next to the C unpickler's load.

The readers never format attacker data into a message (no ``str()``, ``repr()``, f-string of an unpickled value):
only names they checked first (a ``find_class`` module / name, cut to :data:`NAME_SHOWN` characters).
"""
from __future__ import annotations

from ..core.errors import InputError

MAX_BYTES = 1 << 30  # a .metadata of 1 GiB is ~40x the 235B model's (26 MB); a verl rank file's data.pkl: KBs
WEIGHT_PER_BYTE = 8  # the twin's .metadata: its whole Metadata object weighs ~0.6 nodes per byte
WEIGHT_FLOOR = 1 << 20
MAX_DEPTH = 64  # DCP Metadata -> dict -> TensorStorageMetadata -> list -> chunk -> Size: under 10
MAX_KEY_WEIGHT = 1 << 12  # a MetadataIndex (fqn, offset Size): ~10
NAME_SHOWN = 80


class UnsafePickleError(InputError):
    """A pickle names a global that is not on the allow-list (possibly crafted to run code), or breaks the limits
    of :mod:`ckpt_tools.formats.pickle_scan`."""


def shown(s) -> str:
    """A module / class / attribute name from a pickle, safe to print: a str cut to NAME_SHOWN characters."""
    if type(s) is not str:
        return "(not a name)"
    return s[:NAME_SHOWN] + ("..." if len(s) > NAME_SHOWN else "")


# Opcode byte -> (action code, argument): an int n: n bytes follow; -1, -4, -8: a length of that many bytes, then
# that many bytes; 100: up to a newline; 200: two lines (GLOBAL). The table is pickle's own (Lib/pickletools.py).
ATOM, MEMOIZE, GET, MARK, TUPLE1, TUPLE2, TUPLE3, TUPLE, EMPTY, APPENDS, APPEND, SETITEMS, SETITEM, ADDITEMS, \
    FROZENSET, DICTMARK, GLOBAL, STACKGLOBAL, REDUCE, NEWOBJ, NEWOBJEX, BUILD, PUT, BINPERSID, POP, POPMARK, \
    NOP, STOP = range(28)
_OPS = [None] * 256
for _c, _a, _k in (
        (b"N", ATOM, 0), (b"\x88", ATOM, 0), (b"\x89", ATOM, 0), (b"K", ATOM, 1), (b"M", ATOM, 2), (b"J", ATOM, 4),
        (b"G", ATOM, 8), (b"\x8a", ATOM, -1), (b"\x8b", ATOM, -4), (b"\x8c", ATOM, -1), (b"X", ATOM, -4),
        (b"\x8d", ATOM, -8), (b"C", ATOM, -1), (b"B", ATOM, -4), (b"\x8e", ATOM, -8), (b"U", ATOM, -1),
        (b"T", ATOM, -4), (b"\x96", ATOM, -8), (b"I", ATOM, 100), (b"L", ATOM, 100), (b"F", ATOM, 100),
        (b"S", ATOM, 100), (b"V", ATOM, 100), (b")", ATOM, 0), (b"P", ATOM, 100),
        (b"\x94", MEMOIZE, 0), (b"h", GET, 1), (b"j", GET, 4), (b"g", GET, 100), (b"q", PUT, 1), (b"r", PUT, 4),
        (b"p", PUT, 100), (b"(", MARK, 0), (b"\x85", TUPLE1, 0), (b"\x86", TUPLE2, 0), (b"\x87", TUPLE3, 0),
        (b"t", TUPLE, 0), (b"l", TUPLE, 0), (b"]", EMPTY, 0), (b"}", EMPTY, 0), (b"\x8f", EMPTY, 0),
        (b"e", APPENDS, 0), (b"a", APPEND, 0), (b"u", SETITEMS, 0), (b"s", SETITEM, 0), (b"\x90", ADDITEMS, 0),
        (b"\x91", FROZENSET, 0), (b"d", DICTMARK, 0), (b"c", GLOBAL, 200), (b"\x93", STACKGLOBAL, 0),
        (b"R", REDUCE, 0), (b"\x81", NEWOBJ, 0), (b"\x92", NEWOBJEX, 0), (b"b", BUILD, 0), (b"Q", BINPERSID, 0),
        (b"0", POP, 0), (b"1", POPMARK, 0), (b"\x80", NOP, 1), (b"\x95", NOP, 8), (b".", STOP, 0)):
    _OPS[_c[0]] = (_a, _k)
_FIXED_ATOM = [-1] * 256  # an atom opcode with a fixed-size argument -> its size, opcode byte included
for _i, _e in enumerate(_OPS):
    if _e is not None and _e[0] == ATOM and 0 <= _e[1] < 100:
        _FIXED_ATOM[_i] = 1 + _e[1]
# the globals that hash the items of their argument when called (REDUCE): set(iterable), OrderedDict(pairs)
_HASHING = {("builtins", "set"), ("builtins", "frozenset"), ("__builtin__", "set"), ("__builtin__", "frozenset"),
            ("collections", "OrderedDict")}
_D = 128  # an object is an int: weight * _D + depth; one that may still grow (list, dict, set, an object BUILD
#           fills) a list [that int, shared]


def scan(data, what: str) -> None:
    """Refuse ``data`` (a pickle's bytes) in one line naming ``what`` unless it keeps the limits (module doc)."""
    n = len(data)
    if n > MAX_BYTES:
        raise UnsafePickleError(f"{what}: a pickle of {n} bytes (the limit is {MAX_BYTES})")
    max_w = WEIGHT_FLOOR + WEIGHT_PER_BYTE * n
    mv = memoryview(data)
    ops = _OPS
    fixed = _FIXED_ATOM
    stack: list = []
    marks: list = []
    memo: dict = {}
    names: dict = {}  # id of a GLOBAL's stack int -> (module, name); only GLOBAL's are known
    hashed = 0
    pos = 0
    atom = _D + 1

    class Refused(Exception):
        pass

    def value(c):  # a child's int; a growing object it is in is frozen from now on
        if c.__class__ is list:
            c[1] = True
            return c[0]
        return c

    def made(children, base=1):
        w, d = base, 0
        for c in children:
            c = value(c)
            w += c // _D
            if c % _D > d:
                d = c % _D
        if w > max_w:
            raise Refused(f"an object of {w} nodes expanded (shared-structure fan-out; at most {max_w})")
        if d + 1 >= MAX_DEPTH:
            raise Refused(f"objects nested deeper than {MAX_DEPTH}")
        return w * _D + d + 1

    def grow(c, children, keys=()):
        nonlocal hashed
        if c.__class__ is not list or c[1]:
            raise Refused("a container changed after it was shared")
        for k in keys:
            k = value(k)
            if k // _D > MAX_KEY_WEIGHT:
                raise Refused(f"a dict key or set member of {k // _D} nodes (at most {MAX_KEY_WEIGHT})")
            hashed += k // _D
        if hashed > max_w:
            raise Refused(f"more than {max_w} nodes hashed")
        g = made(children, c[0] // _D)
        c[0] = g - g % _D + max(g % _D, c[0] % _D)

    def pop_mark():
        m = marks.pop()
        items = stack[m:]
        del stack[m:]
        return items

    try:
        while True:
            op = mv[pos]
            # the hot opcodes of a DCP .metadata first (MEMOIZE, BININT1, LONG_BINGET, MARK, BINGET: 2/3 of them)
            if op == 0x94:
                memo[len(memo)] = stack[-1]
                pos += 1
                continue
            if op == 0x4B:  # BININT1
                stack.append(atom)
                pos += 2
                continue
            if op == 0x6A or op == 0x68:  # LONG_BINGET, BINGET
                if op == 0x68:
                    c = memo[mv[pos + 1]]
                    pos += 2
                else:
                    c = memo[int.from_bytes(mv[pos + 1:pos + 5], "little")]
                    pos += 5
                if c.__class__ is list:
                    c[1] = True
                stack.append(c)
                continue
            if op == 0x28:  # MARK
                marks.append(len(stack))
                pos += 1
                continue
            k = fixed[op]
            if k >= 0:  # an atom of a fixed size (NONE, BININT, BININT2, EMPTY_TUPLE, ...)
                stack.append(atom)
                pos += k
                continue
            if op == 0x7D:  # EMPTY_DICT
                stack.append([atom, False])
                pos += 1
                continue
            ent = ops[op]
            if ent is None:
                raise Refused(f"opcode {bytes(mv[pos:pos + 1])!r} (not one a checkpoint pickle uses)")
            act, k = ent
            pos += 1
            if k > 0:
                if k < 100:
                    arg = mv[pos:pos + k]
                    pos += k
                elif k == 100:
                    e = data.index(b"\n", pos)
                    arg = mv[pos:e]
                    pos = e + 1
                else:
                    e = data.index(b"\n", pos)
                    e2 = data.index(b"\n", e + 1)
                    arg = (bytes(mv[pos:e]).decode("latin-1"), bytes(mv[e + 1:e2]).decode("latin-1"))
                    pos = e2 + 1
            elif k < 0:
                pos += int.from_bytes(mv[pos:pos - k], "little") - k
            if act == ATOM:
                stack.append(atom)
            elif act == MEMOIZE:
                memo[len(memo)] = stack[-1]
            elif act == GET:
                c = memo[int(arg) if k == 100 else int.from_bytes(arg, "little")]
                if c.__class__ is list:
                    c[1] = True
                stack.append(c)
            elif act == MARK:
                marks.append(len(stack))
            elif act == TUPLE1:
                stack[-1] = made(stack[-1:])
            elif act == REDUCE or act == NEWOBJ:
                args = stack.pop()
                fn = stack.pop()
                if act == REDUCE and (fn.__class__ is list or names.get(id(fn), ()) in _HASHING or id(fn) not in names):
                    hashed += value(args) // _D  # set(), frozenset(), OrderedDict() hash what they are given
                    if hashed > max_w:
                        raise Refused(f"more than {max_w} nodes hashed")
                stack.append([made((args,)), False])
            elif act == BUILD:
                state = stack.pop()
                grow(stack[-1], (state,))
            elif act == SETITEMS:
                items = pop_mark()
                grow(stack[-1], items, items[::2])
            elif act == TUPLE:
                stack.append(made(pop_mark()))
            elif act == EMPTY:
                stack.append([atom, False])
            elif act == PUT:
                memo[int(arg) if k == 100 else int.from_bytes(arg, "little")] = stack[-1]
            elif act == TUPLE2:
                stack[-2:] = [made(stack[-2:])]
            elif act == TUPLE3:
                stack[-3:] = [made(stack[-3:])]
            elif act == APPENDS:
                items = pop_mark()
                grow(stack[-1], items)
            elif act == APPEND:
                v = stack.pop()
                grow(stack[-1], (v,))
            elif act == SETITEM:
                v = stack.pop()
                key = stack.pop()
                grow(stack[-1], (key, v), (key,))
            elif act == ADDITEMS:
                items = pop_mark()
                grow(stack[-1], items, items)
            elif act == FROZENSET:
                items = pop_mark()
                c = [atom, False]
                grow(c, items, items)
                stack.append(value(c))
            elif act == DICTMARK:
                items = pop_mark()
                c = [atom, False]
                grow(c, items, items[::2])
                stack.append(c)
            elif act == GLOBAL:
                c = [atom, True]  # (a list: its id is its own)
                names[id(c)] = arg
                stack.append(c)
            elif act == STACKGLOBAL:
                del stack[-2:]
                stack.append([atom, True])
            elif act == NEWOBJEX:
                kw = stack.pop()
                args = stack.pop()
                stack[-1] = [made((args, kw)), False]
            elif act == BINPERSID:
                stack[-1] = made(stack[-1:])
            elif act == POP:
                if marks and marks[-1] == len(stack):
                    marks.pop()
                else:
                    stack.pop()
            elif act == POPMARK:
                pop_mark()
            elif act == STOP:
                return
    except Refused as e:
        raise UnsafePickleError(f"{what}: refusing the pickle: {e} (byte {pos}; limits: "
                                f"ckpt_tools/formats/pickle_scan.py)") from None
    except (IndexError, KeyError, ValueError):
        raise UnsafePickleError(f"{what}: refusing the pickle: malformed or truncated (byte {pos})") from None
