"""The data path of a shard: the requests that change the job, the wire, the assembly and checks of streamed
chunks, the optimizer step, the weights read and framed, slices, the data port and shared memory."""
