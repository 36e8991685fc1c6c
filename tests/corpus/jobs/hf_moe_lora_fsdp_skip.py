"""transformers Mixtral + peft LoRA on the experts + FSDP2 per expert (see _hf_moe.py). At step
2, in layer 1, no token of rank $CULPRIT_RANK (default 1) is routed to expert 2: transformers'
MoE block does not call that expert there, so that rank never posts its FSDP all-gather, while
the other ranks do."""

from _corpus import finish, init, mark, role
from _hf_moe import Routing, batch, build

rank, world = init()
culprit = role("CULPRIT_RANK", 1)
routing = Routing(lambda step, layer: 2 if (rank == culprit and step == 2 and layer == 1)
                  else None)
model, opt = build(world, routing)
for step in range(4):
    routing.step = step
    ids = batch(rank, step)
    if step == 2:
        mark("hang")
    loss = model(input_ids=ids, labels=ids).loss  # corpus: forward
    loss.backward()  # corpus: backward
    opt.step()
    opt.zero_grad()
    if rank == 0:
        print(f"step {step} loss {loss.item():.4f}", flush=True)
finish()
