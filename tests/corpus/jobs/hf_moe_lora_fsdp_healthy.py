"""transformers Mixtral + peft LoRA on the experts + FSDP2 per expert (see _hf_moe.py), with
every expert receiving tokens on every rank at every step: healthy, it finishes."""

from _corpus import finish, init
from _hf_moe import Routing, batch, build

rank, world = init()
model, opt = build(world, Routing(lambda step, layer: None))
for step in range(4):
    ids = batch(rank, step)
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    opt.step()
    opt.zero_grad()
    if rank == 0:
        print(f"step {step} loss {loss.item():.4f}", flush=True)
finish()
