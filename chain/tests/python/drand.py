"""Runs operations of the `bittensor_drand` package for chain/tests/drand_python.rs.

Reads a JSON list of operations on stdin and writes a JSON list of results on stdout, one per
operation: {"ok": ...} or {"error": "..."} when the package raised ValueError.

Operations:
  {"op": "decrypt_with_signature", "data": HEX, "signature": HEX} -> {"ok": plaintext HEX}
      `data` is what `encrypt`/`encrypt_at_round` return: SCALE (ciphertext: Vec<u8>, round: u64).
  {"op": "encrypt_at_round", "plaintext": HEX, "round": N} -> {"ok": {"data": HEX, "round": N}}
      Always to drand quicknet's public key, which the package has built in.
  {"op": "get_encrypted_commit_v2", ...its keyword arguments, hotkey as HEX}
      -> {"ok": {"commit": HEX, "round": N}}
"""

import json
import sys

import bittensor_drand


def run(op):
    kind = op.pop("op")
    if kind == "decrypt_with_signature":
        data = bytes.fromhex(op["data"])
        return bittensor_drand.decrypt_with_signature(data, op["signature"]).hex()
    if kind == "encrypt_at_round":
        data, round_ = bittensor_drand.encrypt_at_round(bytes.fromhex(op["plaintext"]), op["round"])
        return {"data": data.hex(), "round": round_}
    if kind == "get_encrypted_commit_v2":
        op["hotkey"] = bytes.fromhex(op["hotkey"])
        commit, round_ = bittensor_drand.get_encrypted_commit_v2(**op)
        return {"commit": commit.hex(), "round": round_}
    raise SystemExit(f"unknown operation {kind}")


results = []
for op in json.load(sys.stdin):
    try:
        results.append({"ok": run(op)})
    except ValueError as e:
        results.append({"error": str(e)})
json.dump(results, sys.stdout)
