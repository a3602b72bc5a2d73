"""A subnet's life on the localnet through the unmodified `bittensor` 11.x SDK from PyPI.

Run by `localnet/tests/python_sdk.rs` against a freshly spawned localnet:
`python sdk11_flow.py ws://127.0.0.1:PORT`. Exits non-zero with a message on the first step
that does not do what a subtensor node would.
"""

import asyncio
import sys

import bittensor as bt
from bittensor.intents.registration import BurnedRegister
from bittensor.intents.weights import normalize
from bittensor_core import Keypair


class DevWallet:
    """A wallet-shaped object over dev keys (the SDK's KeyedWallet protocol)."""

    def __init__(self, cold: str, hot: str):
        self.coldkey = Keypair.create_from_uri(cold)
        self.coldkeypub = self.coldkey
        self.hotkey = Keypair.create_from_uri(hot)


def step(name: str, ok: bool, detail: object = "") -> None:
    print(f"{'ok  ' if ok else 'FAIL'} {name}: {detail}", flush=True)
    if not ok:
        sys.exit(1)


async def submit(client, call, wallet, signer="coldkey"):
    result = await client.submit_call(call, wallet, signer=signer)
    step(f"{call.module}.{call.function}", bool(result.success), result.message)
    return result


async def next_epoch(client, netuid: int) -> int:
    """Waits for the subnet's next epoch block by subtensor's rule (spec 393: the epoch runs when
    `(block + netuid + 1) % (tempo + 1) == tempo`; `wait_for_epoch` needs spec 404's
    `LastEpochBlock`)."""
    tempo = int(await client.query(bt.storage.SubtensorModule.Tempo, [netuid]))
    block = await client.block() + 1
    while (block + netuid + 1) % (tempo + 1) != tempo:
        block += 1
    await client.wait_for_block(block, timeout=60)
    return block


async def main(url: str) -> None:
    owner = DevWallet("//Alice", "//Alice//owner-hot")
    validator = DevWallet("//Bob", "//Bob//validator-hot")
    miner = DevWallet("//Charlie", "//Charlie//miner-hot")

    async with bt.Subtensor(url) as client:
        block = await client.block()
        step("read block", block >= 0, block)
        balance = await client.balances.get(owner.coldkey.ss58_address)
        step("read balance", balance.rao > 0, balance)
        # The payment-info query the SDK makes for fees and multisig weights.
        transfer = await client.compose(
            bt.calls.Balances.transfer_keep_alive(dest=validator.coldkey.ss58_address, value=10**9)
        )
        weight = await client.estimate_weight(transfer, address=owner.coldkey.ss58_address)
        step("payment info", weight["ref_time"] > 0, weight)

        cost = await client.subnets.subnet_registration_cost()
        step("registration cost", cost.rao > 0, cost)
        before = set(s.netuid for s in await client.subnets.all())
        await submit(client, bt.calls.SubtensorModule.register_network(hotkey=owner.hotkey.ss58_address), owner)
        after = set(s.netuid for s in await client.subnets.all())
        new = sorted(after - before)
        step("subnet created", len(new) == 1, new)
        netuid = new[0]
        await submit(client, bt.calls.SubtensorModule.start_call(netuid=netuid), owner)
        # Plain weights (no drand on the localnet), and no rate limit between the two settings.
        await submit(
            client,
            bt.calls.AdminUtils.sudo_set_commit_reveal_weights_enabled(netuid=netuid, enabled=False),
            owner,
        )

        # Root (Alice is sudo) lifts the 100-block weights rate limit so one tempo suffices.
        inner = await client.compose(
            bt.calls.AdminUtils.sudo_set_weights_set_rate_limit(netuid=netuid, weights_set_rate_limit=0)
        )
        await submit(client, bt.calls.Sudo.sudo(call=inner), owner)

        # The SDK's own `BurnedRegister` intent reads `CollateralLockShare` (a runtime newer than
        # spec 393) and goes only through the MEV shield; the README says why the localnet has
        # neither. If this changes, update the README.
        try:
            await client.execute(BurnedRegister(netuid=netuid), miner)
            step("BurnedRegister intent refused as the README says", False, "it went through")
        except Exception as error:
            step("BurnedRegister intent needs CollateralLockShare", "CollateralLockShare" in str(error), error)
        for wallet in (validator, miner):
            await submit(
                client,
                bt.calls.SubtensorModule.burned_register(netuid=netuid, hotkey=wallet.hotkey.ss58_address),
                wallet,
            )
            uid = await client.neurons.uid(wallet.hotkey.ss58_address, netuid)
            step("registered", uid is not None, uid)
        await submit(
            client,
            bt.calls.SubtensorModule.add_stake(
                hotkey=validator.hotkey.ss58_address, netuid=netuid, amount_staked=100 * 10**9
            ),
            validator,
        )
        await submit(
            client,
            bt.calls.SubtensorModule.serve_axon(
                netuid=netuid, version=1, ip=2130706433, port=8091, ip_type=4,
                protocol=4, placeholder1=0, placeholder2=0,
            ),
            miner,
            signer="hotkey",
        )

        graph = await client.subnets.metagraph(netuid, commitments=False)
        step("metagraph", graph is not None and len(graph.neurons) == 3, graph)
        miner_uid = graph.by_hotkey(miner.hotkey.ss58_address).uid
        step("axon served", graph.neuron(miner_uid).axon is not None, graph.neuron(miner_uid))

        # The validator gets its permit at an epoch.
        epoch = await next_epoch(client, netuid)
        graph = await client.subnets.metagraph(netuid, commitments=False)
        validator_uid = graph.by_hotkey(validator.hotkey.ss58_address).uid
        step("validator permit", graph.neuron(validator_uid).validator_permit, epoch)
        # The SDK's own float -> u16 conversion, sent as the call its SetWeights intent builds
        # (the intent itself preflights `SubnetEpochConsensus`, storage newer than spec 393).
        uids, values = normalize([miner_uid, validator_uid], [0.75, 0.25])
        step("SDK weight conversion", values == [65535, 21845], values)
        await submit(
            client,
            bt.calls.SubtensorModule.set_mechanism_weights(
                netuid=netuid, mecid=0, dests=uids, weights=values, version_key=0
            ),
            validator,
            signer="hotkey",
        )
        await next_epoch(client, netuid)
        graph = await client.subnets.metagraph(netuid, commitments=False)
        incentive = graph.neuron(miner_uid).incentive
        step("incentive after a tempo", incentive > 0, incentive)
        print("SDK11 FLOW PASSED", flush=True)


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1]))
