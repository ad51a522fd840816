import kvhal


def test_cpu_selected_when_alone(registry):
    device = registry.select()
    assert device.plugin_name == "cpu"
    assert device.descriptor.torch_device_type == "cpu"


def test_copy_round_trip_smoke(cpu):
    import torch

    g = kvhal.KVGeometry(
        num_layers=2, num_blocks=8, block_size=4, num_kv_heads=2, head_size=8, dtype=torch.float32
    )
    cache = cpu.allocate_kv_cache(g)
    for layer in cache.layers:
        layer[0].copy_(torch.randn_like(layer[0]))
    host = cpu.allocate_host_cache(g, cache.layout, 4)
    cpu.synchronize_event(cpu.copy_blocks(cache, host, [(3, 1)]))
    assert torch.equal(kvhal.get_kv_from_block(cache, 3), kvhal.get_kv_from_block(host, 1))
    assert not torch.equal(kvhal.get_kv_from_block(cache, 3), kvhal.get_kv_from_block(host, 0))
