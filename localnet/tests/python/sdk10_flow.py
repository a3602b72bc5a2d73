"""The same subnet life through the previous client generation: `bittensor` 10.x on
`async-substrate-interface` (the stack btcli 9.x uses). Run by `localnet/tests/python_sdk.rs`:
`python sdk10_flow.py ws://127.0.0.1:PORT`.
"""

import asyncio
import sys
import tempfile

import bittensor as bt
from bittensor_wallet import Keypair, Wallet

NO_MEV = dict(mev_protection=False, wait_for_inclusion=True, wait_for_finalization=True)


def step(name: str, ok: bool, detail: object = "") -> None:
    print(f"{'ok  ' if ok else 'FAIL'} {name}: {detail}", flush=True)
    if not ok:
        sys.exit(1)


def dev_wallet(root: str, cold: str, hot: str) -> Wallet:
    wallet = Wallet(name=cold.strip("/"), hotkey="hot", path=root)
    coldkey = Keypair.create_from_uri(cold)
    wallet.set_coldkey(coldkey, encrypt=False, overwrite=True)
    wallet.set_coldkeypub(coldkey, overwrite=True)
    wallet.set_hotkey(Keypair.create_from_uri(hot), encrypt=False, overwrite=True)
    return wallet


def expect(name: str, response) -> None:
    step(name, bool(response.success), response.message)


async def sudo(sub, wallet, function: str, params: dict) -> None:
    inner = await sub.substrate.compose_call("AdminUtils", function, params)
    call = await sub.substrate.compose_call("Sudo", "sudo", {"call": inner})
    response = await sub.sign_and_send_extrinsic(call=call, wallet=wallet, wait_for_finalization=True)
    expect(f"Sudo.sudo({function})", response)


async def next_epoch(sub, netuid: int) -> int:
    """The next block where `(block + netuid + 1) % (tempo + 1) == tempo` (subtensor's rule)."""
    tempo = int((await sub.substrate.query("SubtensorModule", "Tempo", [netuid])).value)
    block = await sub.get_current_block() + 1
    while (block + netuid + 1) % (tempo + 1) != tempo:
        block += 1
    while await sub.get_current_block() < block:
        await asyncio.sleep(0.05)
    return block


async def main(url: str) -> None:
    root = tempfile.mkdtemp(prefix="iota-sdk10-")
    owner = dev_wallet(root, "//Alice", "//Alice//owner-hot")
    validator = dev_wallet(root, "//Bob", "//Bob//validator-hot")
    miner = dev_wallet(root, "//Charlie", "//Charlie//miner-hot")

    async with bt.AsyncSubtensor(network=url) as sub:
        block = await sub.get_current_block()
        step("read block", block >= 0, block)
        balance = await sub.get_balance(owner.coldkeypub.ss58_address)
        step("read balance", balance.rao > 0, balance)
        # The fee queries the SDK makes before a transfer (`TransactionPaymentApi.query_info`).
        # `get_transfer_fee` falls back to 0.02 TAO when the query fails; the localnet charges none.
        dest = validator.coldkeypub.ss58_address
        fee = await sub.get_transfer_fee(owner, dest, bt.Balance.from_tao(1))
        step("transfer fee", fee.rao == 0, fee)
        transfer = await sub.substrate.compose_call(
            "Balances", "transfer_keep_alive", {"dest": dest, "value": 10**9}
        )
        info = await sub.substrate.get_payment_info(transfer, owner.coldkeypub)
        step("payment info", info["weight"]["ref_time"] > 0 and info["partial_fee"] == 0, info)

        before = set(await sub.get_all_subnets_netuid())
        expect("register_subnet", await sub.register_subnet(owner, **NO_MEV))
        new = sorted(set(await sub.get_all_subnets_netuid()) - before)
        step("subnet created", len(new) == 1, new)
        netuid = new[0]
        expect("start_call", await sub.start_call(owner, netuid, **NO_MEV))
        await sudo(sub, owner, "sudo_set_commit_reveal_weights_enabled", {"netuid": netuid, "enabled": False})
        await sudo(sub, owner, "sudo_set_weights_set_rate_limit", {"netuid": netuid, "weights_set_rate_limit": 0})

        for wallet in (validator, miner):
            expect("burned_register", await sub.burned_register(wallet, netuid, **NO_MEV))
            uid = await sub.get_uid_for_hotkey_on_subnet(wallet.hotkey.ss58_address, netuid)
            step("registered", uid is not None, uid)
        expect(
            "add_stake",
            await sub.add_stake(
                validator, netuid, validator.hotkey.ss58_address, bt.Balance.from_tao(100), **NO_MEV
            ),
        )
        axon = bt.Axon(wallet=miner, ip="127.0.0.1", port=8091, external_ip="127.0.0.1", external_port=8091)
        expect("serve_axon", await sub.serve_axon(netuid, axon, **NO_MEV))

        graph = await sub.metagraph(netuid)
        step("metagraph", len(graph.hotkeys) == 3, graph)
        miner_uid = graph.hotkeys.index(miner.hotkey.ss58_address)
        validator_uid = graph.hotkeys.index(validator.hotkey.ss58_address)
        step("axon served", graph.axons[miner_uid].port == 8091, graph.axons[miner_uid])

        await next_epoch(sub, netuid)
        graph = await sub.metagraph(netuid)
        step("validator permit", bool(graph.validator_permit[validator_uid]), graph.validator_permit)
        expect(
            "set_weights",
            await sub.set_weights(
                validator, netuid, uids=[miner_uid, validator_uid], weights=[0.75, 0.25],
                version_key=0, block_time=0.1, **NO_MEV,
            ),
        )
        await next_epoch(sub, netuid)
        graph = await sub.metagraph(netuid)
        incentive = float(graph.incentive[miner_uid])
        step("incentive after a tempo", incentive > 0, incentive)
        print("SDK10 FLOW PASSED", flush=True)


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1]))
