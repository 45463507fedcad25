"""ScaleLong subclasses of diffusers' UNets: long-skip scaling as part of the model config.

``ScaleLongUNet2DModel`` and ``ScaleLongUNet2DConditionModel`` accept every parameter of their parent (listed
explicitly: diffusers rebuilds a model from the parameters named in ``__init__``'s signature) plus ``lsc_method``
``lsc_kappa`` and ``lsc_reduction``. Their weights are those of the parent plus, for the LS methods only, ``lsc.gates.*``; so a vanilla
folder loads into them (choose the method by keyword) and a CS folder loads back into the vanilla class.
"""

from diffusers import UNet2DConditionModel, UNet2DModel
from diffusers.configuration_utils import register_to_config
from diffusers.models.modeling_utils import ModelMixin

from ..layers.legacy_config import LegacyAutoMapMixin
from ..scalelong.conv_hooks import install_conv_lsc
from ..scalelong.loading import LongSkipScalingLoaderMixin
from ..scalelong.skips import LongSkipLayout, conv_long_skip_layout
from .config_checks import check_conv_unet_config

__all__ = ["ModelMixin", "ScaleLongUNet2DConditionModel", "ScaleLongUNet2DModel"]


class ConvLongSkipsMixin:
    """The long-skip protocol of a diffusers conv UNet: its layout derived from its modules."""

    def long_skip_layout(self) -> LongSkipLayout:
        return conv_long_skip_layout(self)


class ScaleLongUNet2DModel(LegacyAutoMapMixin, ConvLongSkipsMixin, LongSkipScalingLoaderMixin, UNet2DModel):
    """``UNet2DModel`` whose long skips are scaled by ``lsc_method`` (see ``diffusers_scalelong.scalelong``)."""

    @register_to_config
    def __init__(
        self,
        sample_size: int | tuple[int, int] | None = None,
        in_channels: int = 3,
        out_channels: int = 3,
        center_input_sample: bool = False,
        time_embedding_type: str = "positional",
        time_embedding_dim: int | None = None,
        freq_shift: int = 0,
        flip_sin_to_cos: bool = True,
        down_block_types: tuple[str, ...] = ("DownBlock2D", "AttnDownBlock2D", "AttnDownBlock2D", "AttnDownBlock2D"),
        mid_block_type: str | None = "UNetMidBlock2D",
        up_block_types: tuple[str, ...] = ("AttnUpBlock2D", "AttnUpBlock2D", "AttnUpBlock2D", "UpBlock2D"),
        block_out_channels: tuple[int, ...] = (224, 448, 672, 896),
        layers_per_block: int = 2,
        mid_block_scale_factor: float = 1,
        downsample_padding: int = 1,
        downsample_type: str = "conv",
        upsample_type: str = "conv",
        dropout: float = 0.0,
        act_fn: str = "silu",
        attention_head_dim: int | None = 8,
        norm_num_groups: int = 32,
        attn_norm_num_groups: int | None = None,
        norm_eps: float = 1e-5,
        resnet_time_scale_shift: str = "default",
        add_attention: bool = True,
        class_embed_type: str | None = None,
        num_class_embeds: int | None = None,
        num_train_timesteps: int | None = None,
        lsc_method: str = "none",
        lsc_kappa: float = 0.5,
        lsc_reduction: int = 16,
    ):
        check_conv_unet_config(
            "ScaleLongUNet2DModel",
            time_embedding_dim=time_embedding_dim,
            sample_size=sample_size,
            in_channels=in_channels,
            out_channels=out_channels,
            block_out_channels=block_out_channels,
            layers_per_block=layers_per_block,
            norm_num_groups=norm_num_groups,
            norm_eps=norm_eps,
            dropout=dropout,
            num_class_embeds=num_class_embeds,
            attention_head_dim=attention_head_dim,
        )
        super().__init__(
            sample_size=sample_size,
            in_channels=in_channels,
            out_channels=out_channels,
            center_input_sample=center_input_sample,
            time_embedding_type=time_embedding_type,
            time_embedding_dim=time_embedding_dim,
            freq_shift=freq_shift,
            flip_sin_to_cos=flip_sin_to_cos,
            down_block_types=down_block_types,
            mid_block_type=mid_block_type,
            up_block_types=up_block_types,
            block_out_channels=block_out_channels,
            layers_per_block=layers_per_block,
            mid_block_scale_factor=mid_block_scale_factor,
            downsample_padding=downsample_padding,
            downsample_type=downsample_type,
            upsample_type=upsample_type,
            dropout=dropout,
            act_fn=act_fn,
            attention_head_dim=attention_head_dim,
            norm_num_groups=norm_num_groups,
            attn_norm_num_groups=attn_norm_num_groups,
            norm_eps=norm_eps,
            resnet_time_scale_shift=resnet_time_scale_shift,
            add_attention=add_attention,
            class_embed_type=class_embed_type,
            num_class_embeds=num_class_embeds,
            num_train_timesteps=num_train_timesteps,
        )
        install_conv_lsc(self, lsc_method, lsc_kappa, lsc_reduction)


class ScaleLongUNet2DConditionModel(
    LegacyAutoMapMixin, ConvLongSkipsMixin, LongSkipScalingLoaderMixin, UNet2DConditionModel
):
    """``UNet2DConditionModel`` whose long skips are scaled by ``lsc_method``; ControlNet residuals are added to the
    skips before they are scaled (the UNet adds them to ``down_block_res_samples``)."""

    @register_to_config
    def __init__(
        self,
        sample_size: int | tuple[int, int] | None = None,
        in_channels: int = 4,
        out_channels: int = 4,
        center_input_sample: bool = False,
        flip_sin_to_cos: bool = True,
        freq_shift: int = 0,
        down_block_types: tuple[str, ...] = (
            "CrossAttnDownBlock2D",
            "CrossAttnDownBlock2D",
            "CrossAttnDownBlock2D",
            "DownBlock2D",
        ),
        mid_block_type: str | None = "UNetMidBlock2DCrossAttn",
        up_block_types: tuple[str, ...] = (
            "UpBlock2D",
            "CrossAttnUpBlock2D",
            "CrossAttnUpBlock2D",
            "CrossAttnUpBlock2D",
        ),
        only_cross_attention: bool | tuple[bool] = False,
        block_out_channels: tuple[int, ...] = (320, 640, 1280, 1280),
        layers_per_block: int | tuple[int] = 2,
        downsample_padding: int = 1,
        mid_block_scale_factor: float = 1,
        dropout: float = 0.0,
        act_fn: str = "silu",
        norm_num_groups: int | None = 32,
        norm_eps: float = 1e-5,
        cross_attention_dim: int | tuple[int] = 1280,
        transformer_layers_per_block: int | tuple[int] | tuple[tuple] = 1,
        reverse_transformer_layers_per_block: tuple[tuple[int]] | None = None,
        encoder_hid_dim: int | None = None,
        encoder_hid_dim_type: str | None = None,
        attention_head_dim: int | tuple[int] = 8,
        num_attention_heads: int | tuple[int] | None = None,
        dual_cross_attention: bool = False,
        use_linear_projection: bool = False,
        class_embed_type: str | None = None,
        addition_embed_type: str | None = None,
        addition_time_embed_dim: int | None = None,
        num_class_embeds: int | None = None,
        upcast_attention: bool = False,
        resnet_time_scale_shift: str = "default",
        resnet_skip_time_act: bool = False,
        resnet_out_scale_factor: float = 1.0,
        time_embedding_type: str = "positional",
        time_embedding_dim: int | None = None,
        time_embedding_act_fn: str | None = None,
        timestep_post_act: str | None = None,
        time_cond_proj_dim: int | None = None,
        conv_in_kernel: int = 3,
        conv_out_kernel: int = 3,
        projection_class_embeddings_input_dim: int | None = None,
        attention_type: str = "default",
        class_embeddings_concat: bool = False,
        mid_block_only_cross_attention: bool | None = None,
        cross_attention_norm: str | None = None,
        addition_embed_type_num_heads: int = 64,
        lsc_method: str = "none",
        lsc_kappa: float = 0.5,
        lsc_reduction: int = 16,
    ):
        check_conv_unet_config(
            "ScaleLongUNet2DConditionModel",
            time_embedding_dim=time_embedding_dim,
            cross_attention_dim=cross_attention_dim,
            down_block_types=down_block_types,
            sample_size=sample_size,
            in_channels=in_channels,
            out_channels=out_channels,
            block_out_channels=block_out_channels,
            layers_per_block=layers_per_block,
            norm_num_groups=norm_num_groups,
            norm_eps=norm_eps,
            dropout=dropout,
            num_class_embeds=num_class_embeds,
            attention_head_dim=attention_head_dim,
        )
        super().__init__(
            sample_size=sample_size,
            in_channels=in_channels,
            out_channels=out_channels,
            center_input_sample=center_input_sample,
            flip_sin_to_cos=flip_sin_to_cos,
            freq_shift=freq_shift,
            down_block_types=down_block_types,
            mid_block_type=mid_block_type,
            up_block_types=up_block_types,
            only_cross_attention=only_cross_attention,
            block_out_channels=block_out_channels,
            layers_per_block=layers_per_block,
            downsample_padding=downsample_padding,
            mid_block_scale_factor=mid_block_scale_factor,
            dropout=dropout,
            act_fn=act_fn,
            norm_num_groups=norm_num_groups,
            norm_eps=norm_eps,
            cross_attention_dim=cross_attention_dim,
            transformer_layers_per_block=transformer_layers_per_block,
            reverse_transformer_layers_per_block=reverse_transformer_layers_per_block,
            encoder_hid_dim=encoder_hid_dim,
            encoder_hid_dim_type=encoder_hid_dim_type,
            attention_head_dim=attention_head_dim,
            num_attention_heads=num_attention_heads,
            dual_cross_attention=dual_cross_attention,
            use_linear_projection=use_linear_projection,
            class_embed_type=class_embed_type,
            addition_embed_type=addition_embed_type,
            addition_time_embed_dim=addition_time_embed_dim,
            num_class_embeds=num_class_embeds,
            upcast_attention=upcast_attention,
            resnet_time_scale_shift=resnet_time_scale_shift,
            resnet_skip_time_act=resnet_skip_time_act,
            resnet_out_scale_factor=resnet_out_scale_factor,
            time_embedding_type=time_embedding_type,
            time_embedding_dim=time_embedding_dim,
            time_embedding_act_fn=time_embedding_act_fn,
            timestep_post_act=timestep_post_act,
            time_cond_proj_dim=time_cond_proj_dim,
            conv_in_kernel=conv_in_kernel,
            conv_out_kernel=conv_out_kernel,
            projection_class_embeddings_input_dim=projection_class_embeddings_input_dim,
            attention_type=attention_type,
            class_embeddings_concat=class_embeddings_concat,
            mid_block_only_cross_attention=mid_block_only_cross_attention,
            cross_attention_norm=cross_attention_norm,
            addition_embed_type_num_heads=addition_embed_type_num_heads,
        )
        install_conv_lsc(self, lsc_method, lsc_kappa, lsc_reduction)
